/*
 * layers_dense.c -- parameter lists and the layers of a Transformer: linear, embedding,
 * learned positional embedding, layer normalisation, activations, residual add, dropout and
 * softmax cross-entropy. Written against the primitives of accel.h only; see the layer
 * conventions there and docs/layers.md.
 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "layers_internal.h"

/* ------------------------------------------------------------------------------------ */
/* Shared helpers                                                                          */

int ac__layer_alloc(ac_backend *be, size_t n, float **out) {
  void *p = NULL;
  int rc = ac_malloc(be, n * sizeof(float), &p);
  *out = p;
  return rc;
}

void ac__layer_free(ac_backend *be, float **p) {
  if (*p != NULL) ac_free(be, *p);
  *p = NULL;
}

int ac__join_name(char *buf, size_t size, const char *prefix, const char *suffix) {
  if (prefix == NULL || suffix == NULL) return AC_EINVAL;
  int len = snprintf(buf, size, "%s.%s", prefix, suffix);
  return len < 0 || (size_t)len >= size ? AC_EINVAL : AC_OK;
}

int ac__param_named(ac_param *p, ac_backend *be, const char *prefix, const char *suffix, int ndim,
                    const size_t *shape) {
  char name[256];
  memset(p, 0, sizeof *p);
  int rc = ac__join_name(name, sizeof name, prefix, suffix);
  if (rc != AC_OK) return rc;
  return ac_param_init(p, be, name, ndim, shape);
}

uint64_t ac__sub_seed(uint64_t seed, uint64_t i) {
  /* An odd multiplier keeps seeds of different sub-layers far apart in the counter space. */
  return seed * 0x2545F4914F6CDD1Dull + (i + 1) * 0x9E3779B97F4A7C15ull;
}

/* ------------------------------------------------------------------------------------ */
/* Parameter lists                                                                         */

void ac_param_list_init(ac_param_list *l) {
  l->items = NULL;
  l->n = 0;
  l->cap = 0;
}

void ac_param_list_destroy(ac_param_list *l) {
  free(l->items);
  ac_param_list_init(l);
}

int ac_param_list_push(ac_param_list *l, ac_param *p) {
  if (l == NULL || p == NULL) return AC_EINVAL;
  if (l->n == l->cap) {
    size_t cap = l->cap ? 2 * l->cap : 16;
    ac_param **items = realloc(l->items, cap * sizeof *items);
    if (items == NULL) return AC_ENOMEM;
    l->items = items;
    l->cap = cap;
  }
  l->items[l->n++] = p;
  return AC_OK;
}

int ac_param_list_zero_grad(ac_param_list *l) {
  for (size_t i = 0; i < l->n; i++) {
    ac_tensor *g = &l->items[i]->grad;
    int rc = ac_fill_f32(g->be, g->numel, ac_tensor_f32(g), 0.0f);
    if (rc != AC_OK) return rc;
  }
  return AC_OK;
}

size_t ac_param_list_numel(const ac_param_list *l) {
  size_t n = 0;
  for (size_t i = 0; i < l->n; i++) n += l->items[i]->value.numel;
  return n;
}

ac_param *ac_param_list_find(const ac_param_list *l, const char *name) {
  for (size_t i = 0; name != NULL && i < l->n; i++)
    if (strcmp(l->items[i]->name, name) == 0) return l->items[i];
  return NULL;
}

/* ------------------------------------------------------------------------------------ */
/* Linear                                                                                  */

int ac_linear_init(ac_linear *l, ac_backend *be, const char *prefix, size_t in, size_t out,
                   int bias, size_t max_rows, uint64_t seed) {
  int rc;
  memset(l, 0, sizeof *l);
  if (be == NULL || in == 0 || out == 0 || max_rows == 0) return AC_EINVAL;
  l->be = be;
  l->in = in;
  l->out = out;
  l->max_rows = max_rows;
  l->has_bias = bias != 0;
  size_t wshape[2] = {out, in};
  AC__TRY(ac__param_named(&l->weight, be, prefix, "weight", 2, wshape));
  if (l->has_bias) AC__TRY(ac__param_named(&l->bias, be, prefix, "bias", 1, &out));
  float bound = 1.0f / sqrtf((float)in);
  AC__TRY(ac_rand_uniform(be, seed, 0, in * out, -bound, bound, ac_tensor_f32(&l->weight.value)));
  AC__TRY(ac__layer_alloc(be, max_rows * out, &l->y));
  AC__TRY(ac__layer_alloc(be, max_rows * in, &l->dx));
  return AC_OK;
fail:
  ac_linear_destroy(l);
  return rc;
}

void ac_linear_destroy(ac_linear *l) {
  if (l->be == NULL) return;
  ac_param_destroy(&l->weight);
  ac_param_destroy(&l->bias);
  ac__layer_free(l->be, &l->y);
  ac__layer_free(l->be, &l->dx);
  memset(l, 0, sizeof *l);
}

int ac_linear_params(ac_linear *l, ac_param_list *list) {
  int rc = ac_param_list_push(list, &l->weight);
  if (rc == AC_OK && l->has_bias) rc = ac_param_list_push(list, &l->bias);
  return rc;
}

int ac_linear_forward(ac_linear *l, const float *x, size_t rows, const float **y) {
  if (l->be == NULL || x == NULL || y == NULL || rows == 0 || rows > l->max_rows) return AC_EINVAL;
  int rc;
  const float *w = ac_tensor_f32(&l->weight.value);
  AC__TRY(ac_sgemm(l->be, AC_NO_TRANS, AC_TRANS, rows, l->out, l->in, 1.0f, x, l->in, w, l->in,
                   0.0f, l->y, l->out));
  if (l->has_bias)
    AC__TRY(
        ac_bcast(l->be, AC_BIN_ADD, rows, l->out, 1, l->y, ac_tensor_f32(&l->bias.value), l->y));
  l->x = x;
  l->rows = rows;
  l->ready = 1;
  *y = l->y;
  return AC_OK;
fail:
  return rc;
}

int ac_linear_backward(ac_linear *l, const float *dy, const float **dx) {
  if (l->be == NULL || !l->ready || dy == NULL) return AC_EINVAL;
  int rc;
  if (l->hook.fn != NULL) {
    ac_hook_view v = {.kind = AC_HOOK_DENSE,
                      .weight = &l->weight,
                      .bias = l->has_bias ? &l->bias : NULL,
                      .batch = l->rows,
                      .rows = l->rows,
                      .in = l->in,
                      .out = l->out,
                      .a = l->x,
                      .lda = l->in,
                      .g = dy,
                      .ldg = l->out};
    AC__TRY(l->hook.fn(l->hook.ctx, &v));
  }
  /* dW += dy^T x; db += column sums of dy; dx = dy W. */
  AC__TRY(ac_sgemm(l->be, AC_TRANS, AC_NO_TRANS, l->out, l->in, l->rows, 1.0f, dy, l->out, l->x,
                   l->in, 1.0f, ac_tensor_f32(&l->weight.grad), l->in));
  if (l->has_bias)
    AC__TRY(ac_reduce(l->be, AC_REDUCE_SUM, l->rows, l->out, 1, 1.0f, dy, 1.0f,
                      ac_tensor_f32(&l->bias.grad)));
  if (dx != NULL) {
    AC__TRY(ac_sgemm(l->be, AC_NO_TRANS, AC_NO_TRANS, l->rows, l->in, l->out, 1.0f, dy, l->out,
                     ac_tensor_f32(&l->weight.value), l->in, 0.0f, l->dx, l->in));
    *dx = l->dx;
  }
  return AC_OK;
fail:
  return rc;
}

/* ------------------------------------------------------------------------------------ */
/* Embedding                                                                               */

int ac_embedding_init(ac_embedding *l, ac_backend *be, const char *prefix, size_t vocab, size_t dim,
                      size_t max_rows, uint64_t seed) {
  int rc;
  memset(l, 0, sizeof *l);
  if (be == NULL || vocab == 0 || dim == 0 || max_rows == 0) return AC_EINVAL;
  l->be = be;
  l->vocab = vocab;
  l->dim = dim;
  l->max_rows = max_rows;
  size_t shape[2] = {vocab, dim};
  AC__TRY(ac__param_named(&l->weight, be, prefix, "weight", 2, shape));
  AC__TRY(ac_rand_normal(be, seed, 0, vocab * dim, 0.0f, 0.02f, ac_tensor_f32(&l->weight.value)));
  AC__TRY(ac__layer_alloc(be, max_rows * dim, &l->y));
  return AC_OK;
fail:
  ac_embedding_destroy(l);
  return rc;
}

void ac_embedding_destroy(ac_embedding *l) {
  if (l->be == NULL) return;
  ac_param_destroy(&l->weight);
  ac__layer_free(l->be, &l->y);
  memset(l, 0, sizeof *l);
}

int ac_embedding_params(ac_embedding *l, ac_param_list *list) {
  return ac_param_list_push(list, &l->weight);
}

int ac_embedding_forward(ac_embedding *l, const int32_t *idx, size_t rows, const float **y) {
  if (l->be == NULL || idx == NULL || y == NULL || rows == 0 || rows > l->max_rows)
    return AC_EINVAL;
  int rc =
      ac_gather_rows(l->be, rows, l->dim, ac_tensor_f32(&l->weight.value), l->vocab, idx, l->y);
  if (rc != AC_OK) return rc;
  l->idx = idx;
  l->rows = rows;
  l->ready = 1;
  *y = l->y;
  return AC_OK;
}

int ac_embedding_backward(ac_embedding *l, const float *dy) {
  if (l->be == NULL || !l->ready || dy == NULL) return AC_EINVAL;
  return ac_scatter_add_rows(l->be, l->rows, l->dim, dy, l->idx, ac_tensor_f32(&l->weight.grad),
                             l->vocab);
}

/* ------------------------------------------------------------------------------------ */
/* Learned positional embedding                                                            */

int ac_posembed_init(ac_posembed *l, ac_backend *be, const char *prefix, size_t max_t, size_t dim,
                     size_t max_batch, uint64_t seed) {
  int rc;
  memset(l, 0, sizeof *l);
  if (be == NULL || max_t == 0 || dim == 0 || max_batch == 0) return AC_EINVAL;
  l->be = be;
  l->max_t = max_t;
  l->dim = dim;
  l->max_batch = max_batch;
  size_t shape[2] = {max_t, dim};
  AC__TRY(ac__param_named(&l->weight, be, prefix, "weight", 2, shape));
  AC__TRY(ac_rand_normal(be, seed, 0, max_t * dim, 0.0f, 0.02f, ac_tensor_f32(&l->weight.value)));
  AC__TRY(ac__layer_alloc(be, max_batch * max_t * dim, &l->y));
  return AC_OK;
fail:
  ac_posembed_destroy(l);
  return rc;
}

void ac_posembed_destroy(ac_posembed *l) {
  if (l->be == NULL) return;
  ac_param_destroy(&l->weight);
  ac__layer_free(l->be, &l->y);
  memset(l, 0, sizeof *l);
}

int ac_posembed_params(ac_posembed *l, ac_param_list *list) {
  return ac_param_list_push(list, &l->weight);
}

int ac_posembed_forward(ac_posembed *l, const float *x, size_t batch, size_t t, const float **y) {
  if (l->be == NULL || x == NULL || y == NULL || batch == 0 || batch > l->max_batch || t == 0 ||
      t > l->max_t)
    return AC_EINVAL;
  /* P's first t rows are contiguous: one broadcast over the batch. */
  int rc =
      ac_bcast(l->be, AC_BIN_ADD, batch, t * l->dim, 1, x, ac_tensor_f32(&l->weight.value), l->y);
  if (rc != AC_OK) return rc;
  l->batch = batch;
  l->t = t;
  l->ready = 1;
  *y = l->y;
  return AC_OK;
}

int ac_posembed_backward(ac_posembed *l, const float *dy, const float **dx) {
  if (l->be == NULL || !l->ready || dy == NULL) return AC_EINVAL;
  int rc = ac_reduce(l->be, AC_REDUCE_SUM, l->batch, l->t * l->dim, 1, 1.0f, dy, 1.0f,
                     ac_tensor_f32(&l->weight.grad));
  if (rc == AC_OK && dx != NULL) *dx = dy;
  return rc;
}

/* ------------------------------------------------------------------------------------ */
/* Layer normalisation                                                                     */

int ac_layernorm_init(ac_layernorm *l, ac_backend *be, const char *prefix, size_t dim, float eps,
                      size_t max_rows) {
  int rc;
  memset(l, 0, sizeof *l);
  if (be == NULL || dim == 0 || max_rows == 0 || !(eps > 0.0f)) return AC_EINVAL;
  l->be = be;
  l->dim = dim;
  l->eps = eps;
  l->max_rows = max_rows;
  AC__TRY(ac__param_named(&l->weight, be, prefix, "weight", 1, &dim));
  AC__TRY(ac__param_named(&l->bias, be, prefix, "bias", 1, &dim));
  AC__TRY(ac_fill_f32(be, dim, ac_tensor_f32(&l->weight.value), 1.0f));
  AC__TRY(ac__layer_alloc(be, max_rows * dim, &l->y));
  AC__TRY(ac__layer_alloc(be, max_rows * dim, &l->dx));
  AC__TRY(ac__layer_alloc(be, max_rows, &l->mean));
  AC__TRY(ac__layer_alloc(be, max_rows, &l->rstd));
  return AC_OK;
fail:
  ac_layernorm_destroy(l);
  return rc;
}

void ac_layernorm_destroy(ac_layernorm *l) {
  if (l->be == NULL) return;
  ac_param_destroy(&l->weight);
  ac_param_destroy(&l->bias);
  float **bufs[] = {&l->y, &l->dx, &l->mean, &l->rstd};
  for (size_t i = 0; i < sizeof bufs / sizeof bufs[0]; i++) ac__layer_free(l->be, bufs[i]);
  memset(l, 0, sizeof *l);
}

int ac_layernorm_params(ac_layernorm *l, ac_param_list *list) {
  int rc = ac_param_list_push(list, &l->weight);
  return rc == AC_OK ? ac_param_list_push(list, &l->bias) : rc;
}

int ac_layernorm_forward(ac_layernorm *l, const float *x, size_t rows, const float **y) {
  if (l->be == NULL || x == NULL || y == NULL || rows == 0 || rows > l->max_rows) return AC_EINVAL;
  int rc = ac_layernorm_rows(l->be, rows, l->dim, l->eps, x, ac_tensor_f32(&l->weight.value),
                             ac_tensor_f32(&l->bias.value), l->y, l->mean, l->rstd);
  if (rc != AC_OK) return rc;
  l->x = x;
  l->rows = rows;
  l->ready = 1;
  *y = l->y;
  return AC_OK;
}

int ac_layernorm_backward(ac_layernorm *l, const float *dy, const float **dx) {
  if (l->be == NULL || !l->ready || dy == NULL) return AC_EINVAL;
  /* The primitive always produces dx with the parameter gradients. */
  int rc = ac_layernorm_rows_backward(l->be, l->rows, l->dim, l->x, ac_tensor_f32(&l->weight.value),
                                      l->mean, l->rstd, dy, l->dx, ac_tensor_f32(&l->weight.grad),
                                      ac_tensor_f32(&l->bias.grad));
  if (rc == AC_OK && dx != NULL) *dx = l->dx;
  return rc;
}

/* ------------------------------------------------------------------------------------ */
/* Activation                                                                              */

int ac_activation_init(ac_activation *l, ac_backend *be, ac_unary_op op, size_t max_n) {
  int rc;
  memset(l, 0, sizeof *l);
  if (be == NULL || max_n == 0 || (int)op < 0 || op >= AC_UNARY_COUNT) return AC_EINVAL;
  l->be = be;
  l->op = op;
  l->max_n = max_n;
  AC__TRY(ac__layer_alloc(be, max_n, &l->y));
  AC__TRY(ac__layer_alloc(be, max_n, &l->dx));
  return AC_OK;
fail:
  ac_activation_destroy(l);
  return rc;
}

void ac_activation_destroy(ac_activation *l) {
  if (l->be == NULL) return;
  ac__layer_free(l->be, &l->y);
  ac__layer_free(l->be, &l->dx);
  memset(l, 0, sizeof *l);
}

int ac_activation_forward(ac_activation *l, const float *x, size_t n, const float **y) {
  if (l->be == NULL || x == NULL || y == NULL || n == 0 || n > l->max_n) return AC_EINVAL;
  int rc = ac_unary(l->be, l->op, n, x, l->y);
  if (rc != AC_OK) return rc;
  l->x = x;
  l->n = n;
  l->ready = 1;
  *y = l->y;
  return AC_OK;
}

int ac_activation_backward(ac_activation *l, const float *dy, const float **dx) {
  if (l->be == NULL || !l->ready || dy == NULL) return AC_EINVAL;
  if (dx == NULL) return AC_OK;
  int rc = ac_unary_backward(l->be, l->op, l->n, l->x, dy, l->dx);
  if (rc == AC_OK) *dx = l->dx;
  return rc;
}

/* ------------------------------------------------------------------------------------ */
/* Residual add                                                                            */

int ac_residual_init(ac_residual *l, ac_backend *be, size_t max_n) {
  memset(l, 0, sizeof *l);
  if (be == NULL || max_n == 0) return AC_EINVAL;
  l->be = be;
  l->max_n = max_n;
  int rc = ac__layer_alloc(be, max_n, &l->y);
  if (rc != AC_OK) ac_residual_destroy(l);
  return rc;
}

void ac_residual_destroy(ac_residual *l) {
  if (l->be == NULL) return;
  ac__layer_free(l->be, &l->y);
  memset(l, 0, sizeof *l);
}

int ac_residual_forward(ac_residual *l, const float *a, const float *b, size_t n, const float **y) {
  if (l->be == NULL || a == NULL || b == NULL || y == NULL || n == 0 || n > l->max_n)
    return AC_EINVAL;
  int rc = ac_binary(l->be, AC_BIN_ADD, n, a, b, l->y);
  if (rc != AC_OK) return rc;
  l->n = n;
  l->ready = 1;
  *y = l->y;
  return AC_OK;
}

int ac_residual_backward(ac_residual *l, const float *dy, const float **da, const float **db) {
  if (l->be == NULL || !l->ready || dy == NULL) return AC_EINVAL;
  if (da != NULL) *da = dy;
  if (db != NULL) *db = dy;
  return AC_OK;
}

/* ------------------------------------------------------------------------------------ */
/* Dropout                                                                                 */

int ac_dropout_init(ac_dropout *l, ac_backend *be, float p, uint64_t seed, size_t max_n) {
  int rc;
  memset(l, 0, sizeof *l);
  if (be == NULL || max_n == 0 || !(p >= 0.0f && p < 1.0f)) return AC_EINVAL;
  l->be = be;
  l->p = p;
  l->seed = seed;
  l->max_n = max_n;
  if (p > 0.0f) {
    AC__TRY(ac__layer_alloc(be, max_n, &l->mask));
    AC__TRY(ac__layer_alloc(be, max_n, &l->y));
    AC__TRY(ac__layer_alloc(be, max_n, &l->dx));
  }
  return AC_OK;
fail:
  ac_dropout_destroy(l);
  return rc;
}

void ac_dropout_destroy(ac_dropout *l) {
  if (l->be == NULL) return;
  ac__layer_free(l->be, &l->mask);
  ac__layer_free(l->be, &l->y);
  ac__layer_free(l->be, &l->dx);
  memset(l, 0, sizeof *l);
}

int ac_dropout_forward(ac_dropout *l, const float *x, size_t n, ac_mode mode, const float **y) {
  if (l->be == NULL || x == NULL || y == NULL || n == 0 || n > l->max_n ||
      (mode != AC_MODE_TRAIN && mode != AC_MODE_EVAL))
    return AC_EINVAL;
  l->n = n;
  l->active = mode == AC_MODE_TRAIN && l->p > 0.0f;
  if (!l->active) {
    l->ready = 1;
    *y = x;
    return AC_OK;
  }
  int rc;
  AC__TRY(ac_dropout_mask(l->be, l->seed, l->offset, n, l->p, l->mask));
  AC__TRY(ac_binary(l->be, AC_BIN_MUL, n, x, l->mask, l->y));
  l->offset += n;
  l->ready = 1;
  *y = l->y;
  return AC_OK;
fail:
  return rc;
}

int ac_dropout_backward(ac_dropout *l, const float *dy, const float **dx) {
  if (l->be == NULL || !l->ready || dy == NULL) return AC_EINVAL;
  if (dx == NULL) return AC_OK;
  if (!l->active) {
    *dx = dy;
    return AC_OK;
  }
  int rc = ac_binary(l->be, AC_BIN_MUL, l->n, dy, l->mask, l->dx);
  if (rc == AC_OK) *dx = l->dx;
  return rc;
}

/* ------------------------------------------------------------------------------------ */
/* Softmax cross-entropy                                                                   */

int ac_celoss_init(ac_celoss *l, ac_backend *be, size_t classes, size_t max_rows) {
  int rc;
  memset(l, 0, sizeof *l);
  if (be == NULL || classes == 0 || max_rows == 0) return AC_EINVAL;
  l->be = be;
  l->classes = classes;
  l->max_rows = max_rows;
  AC__TRY(ac__layer_alloc(be, max_rows * classes, &l->probs));
  AC__TRY(ac__layer_alloc(be, max_rows * classes, &l->dlogits));
  AC__TRY(ac__layer_alloc(be, max_rows, &l->loss));
  AC__TRY(ac__layer_alloc(be, max_rows, &l->counts));
  AC__TRY(ac__layer_alloc(be, classes, &l->ones));
  AC__TRY(ac_fill_f32(be, classes, l->ones, 1.0f));
  return AC_OK;
fail:
  ac_celoss_destroy(l);
  return rc;
}

void ac_celoss_destroy(ac_celoss *l) {
  if (l->be == NULL) return;
  float **bufs[] = {&l->probs, &l->dlogits, &l->loss, &l->counts, &l->ones};
  for (size_t i = 0; i < sizeof bufs / sizeof bufs[0]; i++) ac__layer_free(l->be, bufs[i]);
  memset(l, 0, sizeof *l);
}

int ac_celoss_forward(ac_celoss *l, const float *logits, const int32_t *labels, size_t rows,
                      double *loss) {
  if (l->be == NULL || logits == NULL || labels == NULL || loss == NULL || rows == 0 ||
      rows > l->max_rows)
    return AC_EINVAL;
  int rc;
  double total = 0.0, counted = 0.0;
  AC__TRY(ac_xent_forward(l->be, rows, l->classes, logits, labels, l->probs, l->loss));
  /* Counted rows: gathering from a one-column table of ones gives 1 for a label inside
   * [0, classes) and 0 (the gather's out-of-range row) for an ignored one. */
  AC__TRY(ac_gather_rows(l->be, rows, 1, l->ones, l->classes, labels, l->counts));
  AC__TRY(ac_sum_to_host(l->be, rows, l->counts, &counted));
  AC__TRY(ac_sum_to_host(l->be, rows, l->loss, &total));
  l->labels = labels;
  l->rows = rows;
  l->counted = (size_t)(counted + 0.5);
  l->ready = 1;
  *loss = l->counted ? total / (double)l->counted : 0.0;
  return AC_OK;
fail:
  return rc;
}

int ac_celoss_backward(ac_celoss *l, const float **dlogits) {
  if (l->be == NULL || !l->ready || dlogits == NULL) return AC_EINVAL;
  float scale = l->counted ? 1.0f / (float)l->counted : 0.0f;
  int rc = ac_xent_backward(l->be, l->rows, l->classes, l->probs, l->labels, scale, l->dlogits);
  if (rc == AC_OK) *dlogits = l->dlogits;
  return rc;
}
