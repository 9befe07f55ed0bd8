/*
 * model.c -- model blocks built from the layers of accel.h: the pre-layer-norm Transformer
 * block and a decoder-only Transformer language model; the ResNet basic block and a small
 * ResNet. Same conventions as the layers (caller-allocated structs, layer-owned
 * activations, gradients accumulated into the ac_params).
 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "layers_internal.h"

/* ------------------------------------------------------------------------------------ */
/* Transformer block                                                                       */

int ac_tblock_init(ac_tblock *b, ac_backend *be, const char *prefix, size_t dim, size_t heads,
                   size_t mlp, size_t max_t, size_t max_batch, float dropout, uint64_t seed) {
  int rc;
  char name[256];
  memset(b, 0, sizeof *b);
  if (be == NULL || dim == 0 || mlp == 0 || max_t == 0 || max_batch == 0) return AC_EINVAL;
  b->be = be;
  b->dim = dim;
  b->max_t = max_t;
  b->max_batch = max_batch;
  size_t rows = max_batch * max_t, n = rows * dim;
  AC__TRY(ac__join_name(name, sizeof name, prefix, "ln1"));
  AC__TRY(ac_layernorm_init(&b->ln1, be, name, dim, 1e-5f, rows));
  AC__TRY(ac__join_name(name, sizeof name, prefix, "attn"));
  AC__TRY(
      ac_attention_init(&b->attn, be, name, dim, heads, max_t, max_batch, ac__sub_seed(seed, 0)));
  AC__TRY(ac__join_name(name, sizeof name, prefix, "ln2"));
  AC__TRY(ac_layernorm_init(&b->ln2, be, name, dim, 1e-5f, rows));
  AC__TRY(ac__join_name(name, sizeof name, prefix, "mlp.fc1"));
  AC__TRY(ac_linear_init(&b->fc1, be, name, dim, mlp, 1, rows, ac__sub_seed(seed, 1)));
  AC__TRY(ac_activation_init(&b->gelu, be, AC_UNARY_GELU, rows * mlp));
  AC__TRY(ac__join_name(name, sizeof name, prefix, "mlp.fc2"));
  AC__TRY(ac_linear_init(&b->fc2, be, name, mlp, dim, 1, rows, ac__sub_seed(seed, 2)));
  AC__TRY(ac_dropout_init(&b->drop1, be, dropout, ac__sub_seed(seed, 3), n));
  AC__TRY(ac_dropout_init(&b->drop2, be, dropout, ac__sub_seed(seed, 4), n));
  AC__TRY(ac_residual_init(&b->add1, be, n));
  AC__TRY(ac_residual_init(&b->add2, be, n));
  AC__TRY(ac__layer_alloc(be, n, &b->dh));
  AC__TRY(ac__layer_alloc(be, n, &b->dx));
  return AC_OK;
fail:
  ac_tblock_destroy(b);
  return rc;
}

void ac_tblock_destroy(ac_tblock *b) {
  if (b->be == NULL) return;
  ac_layernorm_destroy(&b->ln1);
  ac_attention_destroy(&b->attn);
  ac_layernorm_destroy(&b->ln2);
  ac_linear_destroy(&b->fc1);
  ac_activation_destroy(&b->gelu);
  ac_linear_destroy(&b->fc2);
  ac_dropout_destroy(&b->drop1);
  ac_dropout_destroy(&b->drop2);
  ac_residual_destroy(&b->add1);
  ac_residual_destroy(&b->add2);
  ac__layer_free(b->be, &b->dh);
  ac__layer_free(b->be, &b->dx);
  memset(b, 0, sizeof *b);
}

int ac_tblock_params(ac_tblock *b, ac_param_list *list) {
  int rc;
  AC__TRY(ac_layernorm_params(&b->ln1, list));
  AC__TRY(ac_attention_params(&b->attn, list));
  AC__TRY(ac_layernorm_params(&b->ln2, list));
  AC__TRY(ac_linear_params(&b->fc1, list));
  AC__TRY(ac_linear_params(&b->fc2, list));
fail:
  return rc;
}

int ac_tblock_forward(ac_tblock *b, const float *x, size_t batch, size_t t, ac_mode mode,
                      const float **y) {
  if (b->be == NULL || x == NULL || y == NULL || batch == 0 || batch > b->max_batch || t == 0 ||
      t > b->max_t)
    return AC_EINVAL;
  int rc;
  size_t rows = batch * t, n = rows * b->dim;
  const float *a, *h, *m;
  AC__TRY(ac_layernorm_forward(&b->ln1, x, rows, &a));
  AC__TRY(ac_attention_forward(&b->attn, a, batch, t, &a));
  AC__TRY(ac_dropout_forward(&b->drop1, a, n, mode, &a));
  AC__TRY(ac_residual_forward(&b->add1, x, a, n, &h));
  AC__TRY(ac_layernorm_forward(&b->ln2, h, rows, &m));
  AC__TRY(ac_linear_forward(&b->fc1, m, rows, &m));
  AC__TRY(ac_activation_forward(&b->gelu, m, rows * b->fc1.out, &m));
  AC__TRY(ac_linear_forward(&b->fc2, m, rows, &m));
  AC__TRY(ac_dropout_forward(&b->drop2, m, n, mode, &m));
  AC__TRY(ac_residual_forward(&b->add2, h, m, n, y));
  b->batch = batch;
  b->t = t;
  b->ready = 1;
  return AC_OK;
fail:
  return rc;
}

int ac_tblock_backward(ac_tblock *b, const float *dy, const float **dx) {
  if (b->be == NULL || !b->ready || dy == NULL) return AC_EINVAL;
  int rc;
  size_t n = b->batch * b->t * b->dim;
  const float *g;
  /* MLP branch, then dh = dy (skip path) + its gradient. */
  AC__TRY(ac_dropout_backward(&b->drop2, dy, &g));
  AC__TRY(ac_linear_backward(&b->fc2, g, &g));
  AC__TRY(ac_activation_backward(&b->gelu, g, &g));
  AC__TRY(ac_linear_backward(&b->fc1, g, &g));
  AC__TRY(ac_layernorm_backward(&b->ln2, g, &g));
  AC__TRY(ac_axpby(b->be, n, 1.0f, dy, 1.0f, g, b->dh));
  /* Attention branch, then dx = dh + its gradient. */
  AC__TRY(ac_dropout_backward(&b->drop1, b->dh, &g));
  AC__TRY(ac_attention_backward(&b->attn, g, &g));
  AC__TRY(ac_layernorm_backward(&b->ln1, g, &g));
  AC__TRY(ac_axpby(b->be, n, 1.0f, b->dh, 1.0f, g, b->dx));
  if (dx != NULL) *dx = b->dx;
  return AC_OK;
fail:
  return rc;
}

/* ------------------------------------------------------------------------------------ */
/* Initialisation chosen by the model config (ac_init)                                     */

/* Redraws p's value from N(0, std^2) with its own seed: the layers drew their default first,
 * and a model-level choice overrides it without the layers knowing about model policies. */
static int redraw_normal(ac_param *p, uint64_t seed, float std) {
  return ac_rand_normal(p->value.be, seed, 0, p->value.numel, 0.0f, std, ac_tensor_f32(&p->value));
}

/* He et al. (2015) with the fan-out mode: std sqrt(2 / (out_c k k)) for W (out_c, in_c, k,
 * k), which keeps the backward pass's variance, as torchvision's ResNet does. */
static int conv_fan_out(ac_conv2d *c, uint64_t seed) {
  const size_t *sh = c->weight.value.shape;
  return redraw_normal(&c->weight, seed, sqrtf(2.0f / (float)(sh[0] * sh[2] * sh[3])));
}

/* ------------------------------------------------------------------------------------ */
/* Transformer language model                                                              */

void ac_lm_config_default(ac_lm_config *c) {
  c->vocab = 256;
  c->ctx = 64;
  c->dim = 128;
  c->heads = 4;
  c->layers = 2;
  c->mlp = 4 * 128;
  c->batch = 32;
  c->dropout = 0.0f;
  c->seed = 1;
  /* Measured on the main job's Transformer (AdamW lr 3e-3, 1000 steps, cosine, seed 1; final
   * eval loss): untied + layer init 1.5158, tied + layer init 1.5562, tied + N(0, 0.02^2)
   * 1.5765. At this size (vocabulary 256, d_model 128) tying the head costs 0.04 nats and
   * GPT-2's init another 0.02, so both stay options (--tie-head, --init normal002) and the
   * defaults are the measured winners. */
  c->tie_head = 0;
  c->init = AC_INIT_LAYER;
}

/* N(0, 0.02^2) for every linear of the model: the blocks' attention and MLP, and the head
 * unless it is the (already N(0, 0.02^2)) embedding. */
static int lm_init_normal002(ac_lm *m) {
  int rc;
  uint64_t s = ac__sub_seed(m->cfg.seed, 3);
  for (size_t i = 0; i < m->cfg.layers; i++) {
    ac_tblock *b = &m->blocks[i];
    ac_param *w[] = {&b->attn.qkv.weight, &b->attn.proj.weight, &b->fc1.weight, &b->fc2.weight};
    for (size_t k = 0; k < sizeof w / sizeof w[0]; k++)
      AC__TRY(redraw_normal(w[k], ac__sub_seed(s, 4 * i + k), 0.02f));
  }
  if (!m->cfg.tie_head)
    AC__TRY(redraw_normal(&m->head.weight, ac__sub_seed(s, 4 * m->cfg.layers), 0.02f));
fail:
  return rc;
}

/* Makes the head's weight a view of the embedding's (same (vocab, dim) layout). Both layers
 * ADD into the shared grad, so its gradient is the sum of the two uses without further
 * code; ac_param_destroy of a view frees nothing. */
static int lm_tie_head(ac_lm *m) {
  int rc;
  ac_param *h = &m->head.weight, *e = &m->tok.weight;
  size_t shape[2] = {m->cfg.vocab, m->cfg.dim};
  ac_tensor_destroy(&h->value);
  ac_tensor_destroy(&h->grad);
  AC__TRY(ac_tensor_view(&h->value, m->be, AC_F32, 2, shape, ac_tensor_f32(&e->value)));
  AC__TRY(ac_tensor_view(&h->grad, m->be, AC_F32, 2, shape, ac_tensor_f32(&e->grad)));
fail:
  return rc;
}

int ac_lm_init(ac_lm *m, ac_backend *be, const ac_lm_config *cfg) {
  int rc;
  char name[64];
  memset(m, 0, sizeof *m);
  if (be == NULL || cfg == NULL || cfg->layers == 0 || cfg->batch == 0 || cfg->ctx == 0 ||
      (cfg->init != AC_INIT_LAYER && cfg->init != AC_INIT_NORMAL002))
    return AC_EINVAL;
  m->be = be;
  m->cfg = *cfg;
  size_t rows = cfg->batch * cfg->ctx;
  uint64_t s = cfg->seed;
  m->blocks = calloc(cfg->layers, sizeof *m->blocks);
  if (m->blocks == NULL) {
    rc = AC_ENOMEM;
    goto fail;
  }
  AC__TRY(ac_embedding_init(&m->tok, be, "tok", cfg->vocab, cfg->dim, rows, ac__sub_seed(s, 0)));
  AC__TRY(ac_posembed_init(&m->pos, be, "pos", cfg->ctx, cfg->dim, cfg->batch, ac__sub_seed(s, 1)));
  for (size_t i = 0; i < cfg->layers; i++) {
    snprintf(name, sizeof name, "layer%zu", i);
    AC__TRY(ac_tblock_init(&m->blocks[i], be, name, cfg->dim, cfg->heads, cfg->mlp, cfg->ctx,
                           cfg->batch, cfg->dropout, ac__sub_seed(s, 10 + i)));
  }
  AC__TRY(ac_layernorm_init(&m->lnf, be, "lnf", cfg->dim, 1e-5f, rows));
  AC__TRY(ac_linear_init(&m->head, be, "head", cfg->dim, cfg->vocab, 1, rows, ac__sub_seed(s, 2)));
  if (cfg->tie_head) AC__TRY(lm_tie_head(m));
  if (cfg->init == AC_INIT_NORMAL002) AC__TRY(lm_init_normal002(m));
  AC__TRY(ac_celoss_init(&m->xent, be, cfg->vocab, rows));
  return AC_OK;
fail:
  ac_lm_destroy(m);
  return rc;
}

void ac_lm_destroy(ac_lm *m) {
  if (m->be == NULL) return;
  ac_embedding_destroy(&m->tok);
  ac_posembed_destroy(&m->pos);
  for (size_t i = 0; m->blocks != NULL && i < m->cfg.layers; i++) ac_tblock_destroy(&m->blocks[i]);
  free(m->blocks);
  ac_layernorm_destroy(&m->lnf);
  ac_linear_destroy(&m->head);
  ac_celoss_destroy(&m->xent);
  memset(m, 0, sizeof *m);
}

int ac_lm_params(ac_lm *m, ac_param_list *list) {
  int rc;
  AC__TRY(ac_embedding_params(&m->tok, list));
  AC__TRY(ac_posembed_params(&m->pos, list));
  for (size_t i = 0; i < m->cfg.layers; i++) AC__TRY(ac_tblock_params(&m->blocks[i], list));
  AC__TRY(ac_layernorm_params(&m->lnf, list));
  if (m->cfg.tie_head)
    AC__TRY(ac_param_list_push(list, &m->head.bias));
  else
    AC__TRY(ac_linear_params(&m->head, list));
fail:
  return rc;
}

int ac_lm_forward(ac_lm *m, const int32_t *tokens, const int32_t *targets, size_t batch, size_t t,
                  ac_mode mode, double *loss) {
  if (m->be == NULL || tokens == NULL || targets == NULL || loss == NULL || batch == 0 ||
      batch > m->cfg.batch || t == 0 || t > m->cfg.ctx)
    return AC_EINVAL;
  int rc;
  size_t rows = batch * t;
  const float *h;
  AC__TRY(ac_embedding_forward(&m->tok, tokens, rows, &h));
  AC__TRY(ac_posembed_forward(&m->pos, h, batch, t, &h));
  for (size_t i = 0; i < m->cfg.layers; i++)
    AC__TRY(ac_tblock_forward(&m->blocks[i], h, batch, t, mode, &h));
  AC__TRY(ac_layernorm_forward(&m->lnf, h, rows, &h));
  AC__TRY(ac_linear_forward(&m->head, h, rows, &m->logits));
  AC__TRY(ac_celoss_forward(&m->xent, m->logits, targets, rows, loss));
  m->batch = batch;
  m->t = t;
  m->ready = 1;
  return AC_OK;
fail:
  return rc;
}

int ac_lm_backward(ac_lm *m) {
  if (m->be == NULL || !m->ready) return AC_EINVAL;
  int rc;
  const float *g;
  AC__TRY(ac_celoss_backward(&m->xent, &g));
  AC__TRY(ac_linear_backward(&m->head, g, &g));
  AC__TRY(ac_layernorm_backward(&m->lnf, g, &g));
  for (size_t i = m->cfg.layers; i-- > 0;) AC__TRY(ac_tblock_backward(&m->blocks[i], g, &g));
  AC__TRY(ac_posembed_backward(&m->pos, g, &g));
  AC__TRY(ac_embedding_backward(&m->tok, g));
  return AC_OK;
fail:
  return rc;
}

/* ------------------------------------------------------------------------------------ */
/* ResNet basic block                                                                      */

static size_t conv_out(size_t x, size_t stride) {
  return (x + 2 - 3) / stride + 1; /* 3x3, pad 1 */
}

static size_t max3(size_t a, size_t b, size_t c) {
  size_t m = a > b ? a : b;
  return m > c ? m : c;
}

size_t ac_basicblock_workspace_floats(size_t in_c, size_t out_c, size_t h, size_t w, size_t stride,
                                      size_t chunk) {
  if (stride == 0 || h == 0 || w == 0) return 0;
  size_t oh = conv_out(h, stride), ow = conv_out(w, stride);
  return max3(ac_conv2d_workspace_floats(in_c, out_c, 3, oh, ow, chunk),
              ac_conv2d_workspace_floats(out_c, out_c, 3, oh, ow, chunk),
              ac_conv2d_workspace_floats(in_c, out_c, 1, oh, ow, chunk));
}

int ac_basicblock_init(ac_basicblock *b, ac_backend *be, const char *prefix, size_t in_c,
                       size_t out_c, size_t h, size_t w, size_t stride, size_t max_batch,
                       size_t chunk, float *workspace, uint64_t seed) {
  int rc;
  char name[256];
  memset(b, 0, sizeof *b);
  if (be == NULL || in_c == 0 || out_c == 0 || max_batch == 0 || stride == 0) return AC_EINVAL;
  b->be = be;
  b->in_c = in_c;
  b->out_c = out_c;
  AC__TRY(ac__join_name(name, sizeof name, prefix, "conv1"));
  AC__TRY(ac_conv2d_init(&b->conv1, be, name, in_c, out_c, h, w, 3, stride, 1, 0, max_batch, chunk,
                         workspace, ac__sub_seed(seed, 0)));
  b->oh = b->conv1.oh;
  b->ow = b->conv1.ow;
  size_t ohw = b->oh * b->ow;
  AC__TRY(ac__join_name(name, sizeof name, prefix, "bn1"));
  AC__TRY(ac_batchnorm_init(&b->bn1, be, name, out_c, ohw, 1e-5f, 0.1f, max_batch));
  AC__TRY(ac_batchnorm_fuse_relu(&b->bn1));
  AC__TRY(ac_conv2d_want_moments(&b->conv1)); /* bn1's statistics made while conv1 writes */
  AC__TRY(ac__join_name(name, sizeof name, prefix, "conv2"));
  AC__TRY(ac_conv2d_init(&b->conv2, be, name, out_c, out_c, b->oh, b->ow, 3, 1, 1, 0, max_batch,
                         chunk, workspace, ac__sub_seed(seed, 1)));
  AC__TRY(ac__join_name(name, sizeof name, prefix, "bn2"));
  AC__TRY(ac_batchnorm_init(&b->bn2, be, name, out_c, ohw, 1e-5f, 0.1f, max_batch));
  AC__TRY(ac_batchnorm_fuse_relu(&b->bn2)); /* relu(bn2(.) + shortcut) in one pass */
  AC__TRY(ac_conv2d_want_moments(&b->conv2));
  b->has_short = stride != 1 || in_c != out_c;
  if (b->has_short) {
    AC__TRY(ac__join_name(name, sizeof name, prefix, "short.conv"));
    AC__TRY(ac_conv2d_init(&b->sconv, be, name, in_c, out_c, h, w, 1, stride, 0, 0, max_batch,
                           chunk, workspace, ac__sub_seed(seed, 2)));
    AC__TRY(ac__join_name(name, sizeof name, prefix, "short.bn"));
    AC__TRY(ac_batchnorm_init(&b->sbn, be, name, out_c, ohw, 1e-5f, 0.1f, max_batch));
    AC__TRY(ac_conv2d_want_moments(&b->sconv));
  }
  AC__TRY(ac__layer_alloc(be, max_batch * in_c * h * w, &b->dx));
  return AC_OK;
fail:
  ac_basicblock_destroy(b);
  return rc;
}

void ac_basicblock_destroy(ac_basicblock *b) {
  if (b->be == NULL) return;
  ac_conv2d_destroy(&b->conv1);
  ac_batchnorm_destroy(&b->bn1);
  ac_conv2d_destroy(&b->conv2);
  ac_batchnorm_destroy(&b->bn2);
  ac_conv2d_destroy(&b->sconv);
  ac_batchnorm_destroy(&b->sbn);
  ac__layer_free(b->be, &b->dx);
  memset(b, 0, sizeof *b);
}

int ac_basicblock_params(ac_basicblock *b, ac_param_list *list) {
  int rc;
  AC__TRY(ac_conv2d_params(&b->conv1, list));
  AC__TRY(ac_batchnorm_params(&b->bn1, list));
  AC__TRY(ac_conv2d_params(&b->conv2, list));
  AC__TRY(ac_batchnorm_params(&b->bn2, list));
  if (b->has_short) {
    AC__TRY(ac_conv2d_params(&b->sconv, list));
    AC__TRY(ac_batchnorm_params(&b->sbn, list));
  }
fail:
  return rc;
}

int ac_basicblock_forward(ac_basicblock *b, const float *x, size_t batch, ac_mode mode,
                          const float **y) {
  if (b->be == NULL || x == NULL || y == NULL) return AC_EINVAL;
  int rc;
  const float *a, *s = x;
  AC__TRY(ac_conv2d_forward(&b->conv1, x, batch, &a));
  AC__TRY(ac_batchnorm_forward_moments(&b->bn1, a, NULL, ac_conv2d_moments(&b->conv1), batch, mode,
                                       &a)); /* with relu1 */
  AC__TRY(ac_conv2d_forward(&b->conv2, a, batch, &a));
  if (b->has_short) {
    AC__TRY(ac_conv2d_forward(&b->sconv, x, batch, &s));
    AC__TRY(ac_batchnorm_forward_moments(&b->sbn, s, NULL, ac_conv2d_moments(&b->sconv), batch,
                                         mode, &s));
  }
  AC__TRY(ac_batchnorm_forward_moments(&b->bn2, a, s, ac_conv2d_moments(&b->conv2), batch, mode,
                                       y)); /* + s, relu2 */
  b->batch = batch;
  b->ready = 1;
  return AC_OK;
fail:
  return rc;
}

int ac_basicblock_backward(ac_basicblock *b, const float *dy, const float **dx) {
  return ac_basicblock_backward_bn(b, dy, NULL, dx);
}

/* Each input gradient of a stride-1 conv comes with the sums of the batch norm before it
 * (ac_conv2d_backward_bn): conv2's with bn1's, conv1's with in_bn's. */
int ac_basicblock_backward_bn(ac_basicblock *b, const float *dy, ac_batchnorm *in_bn,
                              const float **dx) {
  if (b->be == NULL || !b->ready || dy == NULL) return AC_EINVAL;
  int rc;
  const float *gm, *gs;
  AC__TRY(ac_batchnorm_backward_res(&b->bn2, dy, &gm, &gs));
  AC__TRY(ac_conv2d_backward_bn(&b->conv2, gm, NULL, NULL, &b->bn1, &gm));
  AC__TRY(ac_batchnorm_backward(&b->bn1, gm, &gm));
  if (b->has_short) { /* first: conv1's input gradient adds the shortcut's as it is made */
    AC__TRY(ac_batchnorm_backward(&b->sbn, gs, &gs));
    AC__TRY(ac_conv2d_backward(&b->sconv, gs, dx != NULL ? &gs : NULL));
  }
  if (dx != NULL) {
    AC__TRY(ac_conv2d_backward_bn(&b->conv1, gm, gs, b->dx, in_bn, dx));
  } else {
    AC__TRY(ac_conv2d_backward(&b->conv1, gm, NULL));
  }
  return AC_OK;
fail:
  return rc;
}

/* ------------------------------------------------------------------------------------ */
/* ResNet                                                                                  */

void ac_resnet_config_default(ac_resnet_config *c) {
  memset(c, 0, sizeof *c);
  c->in_c = 1;
  c->h = 28;
  c->w = 28;
  c->classes = 10;
  c->stages = 3;
  c->blocks = 3;
  c->width[0] = 16;
  c->width[1] = 32;
  c->width[2] = 64;
  c->batch = 128;
  c->chunk = 8;
  c->bn_eps = 1e-5f;
  c->bn_momentum = 0.1f;
  c->seed = 1;
  c->conv_init = AC_INIT_HE_FAN_OUT;
}

/* Every conv of the network: stem, and each block's two convs and projection shortcut. */
static int resnet_conv_fan_out(ac_resnet *m) {
  int rc;
  uint64_t s = ac__sub_seed(m->cfg.seed, 2);
  AC__TRY(conv_fan_out(&m->stem, ac__sub_seed(s, 0)));
  for (size_t k = 0; k < m->nblocks; k++) {
    ac_basicblock *b = &m->blocks[k];
    AC__TRY(conv_fan_out(&b->conv1, ac__sub_seed(s, 3 * k + 1)));
    AC__TRY(conv_fan_out(&b->conv2, ac__sub_seed(s, 3 * k + 2)));
    if (b->has_short) AC__TRY(conv_fan_out(&b->sconv, ac__sub_seed(s, 3 * k + 3)));
  }
fail:
  return rc;
}

int ac_resnet_init(ac_resnet *m, ac_backend *be, const ac_resnet_config *cfg) {
  int rc;
  char name[64];
  memset(m, 0, sizeof *m);
  if (be == NULL || cfg == NULL || cfg->stages == 0 || cfg->stages > AC_RESNET_MAX_STAGES ||
      cfg->blocks == 0 || cfg->batch == 0 || cfg->classes == 0 || cfg->h == 0 || cfg->w == 0 ||
      (cfg->conv_init != AC_INIT_LAYER && cfg->conv_init != AC_INIT_HE_FAN_OUT))
    return AC_EINVAL;
  for (size_t s = 0; s < cfg->stages; s++)
    if (cfg->width[s] == 0) return AC_EINVAL;
  m->be = be;
  m->cfg = *cfg;
  size_t chunk = cfg->chunk == 0 || cfg->chunk > cfg->batch ? cfg->batch : cfg->chunk;
  m->cfg.chunk = chunk;
  m->nblocks = cfg->stages * cfg->blocks;

  /* One im2col workspace for every conv: the largest any of them needs. */
  size_t ws = ac_conv2d_workspace_floats(cfg->in_c, cfg->width[0], 3, cfg->h, cfg->w, chunk);
  size_t h = cfg->h, w = cfg->w, c = cfg->width[0];
  for (size_t s = 0; s < cfg->stages; s++)
    for (size_t i = 0; i < cfg->blocks; i++) {
      size_t stride = s > 0 && i == 0 ? 2 : 1, oc = cfg->width[s];
      size_t need = ac_basicblock_workspace_floats(c, oc, h, w, stride, chunk);
      ws = need > ws ? need : ws;
      h = conv_out(h, stride);
      w = conv_out(w, stride);
      c = oc;
    }
  AC__TRY(ac__layer_alloc(be, ws, &m->ws));

  m->blocks = calloc(m->nblocks, sizeof *m->blocks);
  if (m->blocks == NULL) {
    rc = AC_ENOMEM;
    goto fail;
  }
  uint64_t seed = cfg->seed;
  AC__TRY(ac_conv2d_init(&m->stem, be, "stem.conv", cfg->in_c, cfg->width[0], cfg->h, cfg->w, 3, 1,
                         1, 0, cfg->batch, chunk, m->ws, ac__sub_seed(seed, 0)));
  AC__TRY(ac_batchnorm_init(&m->stem_bn, be, "stem.bn", cfg->width[0], cfg->h * cfg->w, cfg->bn_eps,
                            cfg->bn_momentum, cfg->batch));
  AC__TRY(ac_batchnorm_fuse_relu(&m->stem_bn));
  AC__TRY(ac_conv2d_want_moments(&m->stem));
  h = cfg->h;
  w = cfg->w;
  c = cfg->width[0];
  for (size_t s = 0, k = 0; s < cfg->stages; s++)
    for (size_t i = 0; i < cfg->blocks; i++, k++) {
      size_t stride = s > 0 && i == 0 ? 2 : 1;
      snprintf(name, sizeof name, "stage%zu.block%zu", s, i);
      AC__TRY(ac_basicblock_init(&m->blocks[k], be, name, c, cfg->width[s], h, w, stride,
                                 cfg->batch, chunk, m->ws, ac__sub_seed(seed, 10 + k)));
      /* blocks take their bn settings from the defaults; apply the config's */
      m->blocks[k].bn1.eps = m->blocks[k].bn2.eps = m->blocks[k].sbn.eps = cfg->bn_eps;
      m->blocks[k].bn1.momentum = m->blocks[k].bn2.momentum = cfg->bn_momentum;
      m->blocks[k].sbn.momentum = cfg->bn_momentum;
      h = m->blocks[k].oh;
      w = m->blocks[k].ow;
      c = cfg->width[s];
    }
  AC__TRY(ac_gap_init(&m->gap, be, c, h * w, cfg->batch));
  AC__TRY(ac_linear_init(&m->fc, be, "fc", c, cfg->classes, 1, cfg->batch, ac__sub_seed(seed, 1)));
  if (cfg->conv_init == AC_INIT_HE_FAN_OUT) AC__TRY(resnet_conv_fan_out(m));
  AC__TRY(ac_celoss_init(&m->xent, be, cfg->classes, cfg->batch));
  return AC_OK;
fail:
  ac_resnet_destroy(m);
  return rc;
}

void ac_resnet_destroy(ac_resnet *m) {
  if (m->be == NULL) return;
  ac_conv2d_destroy(&m->stem);
  ac_batchnorm_destroy(&m->stem_bn);
  for (size_t i = 0; m->blocks != NULL && i < m->nblocks; i++) ac_basicblock_destroy(&m->blocks[i]);
  free(m->blocks);
  ac_gap_destroy(&m->gap);
  ac_linear_destroy(&m->fc);
  ac_celoss_destroy(&m->xent);
  ac__layer_free(m->be, &m->ws);
  memset(m, 0, sizeof *m);
}

int ac_resnet_params(ac_resnet *m, ac_param_list *list) {
  int rc;
  AC__TRY(ac_conv2d_params(&m->stem, list));
  AC__TRY(ac_batchnorm_params(&m->stem_bn, list));
  for (size_t i = 0; i < m->nblocks; i++) AC__TRY(ac_basicblock_params(&m->blocks[i], list));
  AC__TRY(ac_linear_params(&m->fc, list));
fail:
  return rc;
}

int ac_resnet_forward(ac_resnet *m, const float *images, const int32_t *labels, size_t batch,
                      ac_mode mode, double *loss) {
  if (m->be == NULL || images == NULL || labels == NULL || loss == NULL || batch == 0 ||
      batch > m->cfg.batch)
    return AC_EINVAL;
  int rc;
  const float *h;
  AC__TRY(ac_conv2d_forward(&m->stem, images, batch, &h));
  AC__TRY(ac_batchnorm_forward_moments(&m->stem_bn, h, NULL, ac_conv2d_moments(&m->stem), batch,
                                       mode, &h)); /* with the ReLU */
  for (size_t i = 0; i < m->nblocks; i++)
    AC__TRY(ac_basicblock_forward(&m->blocks[i], h, batch, mode, &h));
  AC__TRY(ac_gap_forward(&m->gap, h, batch, &h));
  AC__TRY(ac_linear_forward(&m->fc, h, batch, &m->logits));
  AC__TRY(ac_celoss_forward(&m->xent, m->logits, labels, batch, loss));
  m->batch = batch;
  m->ready = 1;
  return AC_OK;
fail:
  return rc;
}

int ac_resnet_backward(ac_resnet *m) {
  if (m->be == NULL || !m->ready) return AC_EINVAL;
  int rc;
  const float *g;
  AC__TRY(ac_celoss_backward(&m->xent, &g));
  AC__TRY(ac_linear_backward(&m->fc, g, &g));
  AC__TRY(ac_gap_backward(&m->gap, g, &g));
  for (size_t i = m->nblocks; i-- > 0;) /* the batch norm before the block: its input's */
    AC__TRY(ac_basicblock_backward_bn(&m->blocks[i], g, i > 0 ? &m->blocks[i - 1].bn2 : &m->stem_bn,
                                      &g));
  AC__TRY(ac_batchnorm_backward(&m->stem_bn, g, &g));
  AC__TRY(ac_conv2d_backward(&m->stem, g, NULL)); /* the images need no gradient */
  return AC_OK;
fail:
  return rc;
}

/* ------------------------------------------------------------------------------------ */
/* Curvature hooks                                                                         */

void ac_resnet_set_hook(ac_resnet *m, const ac_hook *hook) {
  ac_hook h = hook != NULL ? *hook : (ac_hook){NULL, NULL};
  m->stem.hook = h;
  m->stem_bn.hook = h;
  for (size_t i = 0; m->blocks != NULL && i < m->nblocks; i++) {
    ac_basicblock *b = &m->blocks[i];
    b->conv1.hook = b->conv2.hook = h;
    b->bn1.hook = b->bn2.hook = h;
    if (b->has_short) {
      b->sconv.hook = h;
      b->sbn.hook = h;
    }
  }
  m->fc.hook = h;
}

void ac_resnet_set_sync(ac_resnet *m, const ac_bn_sync *sync) {
  ac_bn_sync r = sync != NULL ? *sync : (ac_bn_sync){NULL, NULL, 0};
  m->stem_bn.sync = r;
  for (size_t i = 0; m->blocks != NULL && i < m->nblocks; i++) {
    ac_basicblock *b = &m->blocks[i];
    b->bn1.sync = b->bn2.sync = r;
    if (b->has_short) b->sbn.sync = r;
  }
}

void ac_lm_set_hook(ac_lm *m, const ac_hook *hook) {
  ac_hook h = hook != NULL ? *hook : (ac_hook){NULL, NULL};
  for (size_t i = 0; m->blocks != NULL && i < m->cfg.layers; i++) {
    ac_tblock *b = &m->blocks[i];
    b->attn.qkv.hook = b->attn.proj.hook = h;
    b->fc1.hook = b->fc2.hook = h;
  }
  /* A tied head's weight is the embedding matrix: no layer of its own to precondition. */
  m->head.hook = m->cfg.tie_head ? (ac_hook){NULL, NULL} : h;
}
