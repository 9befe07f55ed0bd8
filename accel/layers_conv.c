/*
 * layers_conv.c -- the layers of a convolutional net: 2-D convolution (im2col + gemm),
 * batch normalisation, max/average pooling and global average pooling, written against
 * the primitives of accel.h (NCHW throughout).
 */
#include <math.h>
#include <string.h>

#include "layers_internal.h"

/* ------------------------------------------------------------------------------------ */
/* 2-D convolution                                                                         */

size_t ac_conv2d_workspace_floats(size_t in_c, size_t k, size_t oh, size_t ow, size_t chunk)
{
  return chunk * in_c * k * k * oh * ow;
}

int ac_conv2d_init(ac_conv2d *l, ac_backend *be, const char *prefix, size_t in_c,
                   size_t out_c, size_t h, size_t w, size_t k, size_t stride, size_t pad,
                   int bias, size_t max_batch, size_t chunk, float *workspace, uint64_t seed)
{
  int rc;
  memset(l, 0, sizeof *l);
  if (be == NULL || in_c == 0 || out_c == 0 || max_batch == 0)
    return AC_EINVAL;
  ac_conv2d_geom g = {max_batch, in_c, h, w, k, k, stride, stride, pad, pad};
  AC__TRY(ac_conv2d_out_hw(&g, &l->oh, &l->ow));
  l->be = be;
  l->g = g;
  l->out_c = out_c;
  l->chunk = chunk == 0 || chunk > max_batch ? max_batch : chunk;
  l->has_bias = bias != 0;
  size_t ckk = in_c * k * k;
  size_t wshape[4] = {out_c, in_c, k, k};
  AC__TRY(ac__param_named(&l->weight, be, prefix, "weight", 4, wshape));
  if (l->has_bias)
    AC__TRY(ac__param_named(&l->bias, be, prefix, "bias", 1, &out_c));
  AC__TRY(ac_rand_normal(be, seed, 0, out_c * ckk, 0.0f, sqrtf(2.0f / (float)ckk),
                         ac_tensor_f32(&l->weight.value)));
  if (workspace != NULL) {
    l->ws = workspace;
  } else {
    AC__TRY(ac__layer_alloc(be, ac_conv2d_workspace_floats(in_c, k, l->oh, l->ow, l->chunk),
                            &l->ws));
    l->owns_ws = 1;
  }
  AC__TRY(ac__layer_alloc(be, max_batch * out_c * l->oh * l->ow, &l->y));
  AC__TRY(ac__layer_alloc(be, max_batch * in_c * h * w, &l->dx));
  return AC_OK;
fail:
  ac_conv2d_destroy(l);
  return rc;
}

void ac_conv2d_destroy(ac_conv2d *l)
{
  if (l->be == NULL)
    return;
  ac_param_destroy(&l->weight);
  ac_param_destroy(&l->bias);
  if (l->owns_ws)
    ac__layer_free(l->be, &l->ws);
  ac__layer_free(l->be, &l->y);
  ac__layer_free(l->be, &l->dx);
  memset(l, 0, sizeof *l);
}

int ac_conv2d_params(ac_conv2d *l, ac_param_list *list)
{
  int rc = ac_param_list_push(list, &l->weight);
  if (rc == AC_OK && l->has_bias)
    rc = ac_param_list_push(list, &l->bias);
  return rc;
}

int ac_conv2d_forward(ac_conv2d *l, const float *x, size_t batch, const float **y)
{
  if (l->be == NULL || x == NULL || y == NULL || batch == 0 || batch > l->g.n)
    return AC_EINVAL;
  int rc;
  ac_backend *be = l->be;
  size_t ckk = l->g.c * l->g.kh * l->g.kw, ohw = l->oh * l->ow, oc = l->out_c;
  size_t chw = l->g.c * l->g.h * l->g.w;
  const float *w = ac_tensor_f32(&l->weight.value);
  for (size_t b0 = 0; b0 < batch; b0 += l->chunk) {
    ac_conv2d_geom g = l->g;
    g.n = batch - b0 < l->chunk ? batch - b0 : l->chunk;
    AC__TRY(ac_im2col(be, &g, x + b0 * chw, l->ws));
    AC__TRY(ac_sgemm_batched(be, AC_NO_TRANS, AC_NO_TRANS, oc, ohw, ckk, 1.0f, w, ckk, 0,
                             l->ws, ohw, ckk * ohw, 0.0f, l->y + b0 * oc * ohw, ohw, oc * ohw,
                             g.n));
  }
  if (l->has_bias)
    AC__TRY(ac_bcast(be, AC_BIN_ADD, batch, oc, ohw, l->y, ac_tensor_f32(&l->bias.value),
                     l->y));
  l->x = x;
  l->batch = batch;
  l->ready = 1;
  *y = l->y;
  return AC_OK;
fail:
  return rc;
}

int ac_conv2d_backward(ac_conv2d *l, const float *dy, const float **dx)
{
  if (l->be == NULL || !l->ready || dy == NULL)
    return AC_EINVAL;
  int rc;
  ac_backend *be = l->be;
  size_t ckk = l->g.c * l->g.kh * l->g.kw, ohw = l->oh * l->ow, oc = l->out_c;
  size_t chw = l->g.c * l->g.h * l->g.w;
  const float *w = ac_tensor_f32(&l->weight.value);
  float *dw = ac_tensor_f32(&l->weight.grad);
  if (l->has_bias)
    AC__TRY(ac_reduce(be, AC_REDUCE_SUM, l->batch, oc, ohw, 1.0f, dy, 1.0f,
                      ac_tensor_f32(&l->bias.grad)));
  for (size_t b0 = 0; b0 < l->batch; b0 += l->chunk) {
    ac_conv2d_geom g = l->g;
    g.n = l->batch - b0 < l->chunk ? l->batch - b0 : l->chunk;
    const float *dyc = dy + b0 * oc * ohw;
    /* The workspace is shared, so im2col is recomputed rather than kept from forward. */
    AC__TRY(ac_im2col(be, &g, l->x + b0 * chw, l->ws));
    for (size_t i = 0; i < g.n; i++)   /* dW += dy_i col_i^T */
      AC__TRY(ac_sgemm(be, AC_NO_TRANS, AC_TRANS, oc, ckk, ohw, 1.0f, dyc + i * oc * ohw, ohw,
                       l->ws + i * ckk * ohw, ohw, 1.0f, dw, ckk));
    if (dx != NULL) {   /* dcol = W^T dy, then scattered back to the image */
      AC__TRY(ac_sgemm_batched(be, AC_TRANS, AC_NO_TRANS, ckk, ohw, oc, 1.0f, w, ckk, 0, dyc,
                               ohw, oc * ohw, 0.0f, l->ws, ohw, ckk * ohw, g.n));
      AC__TRY(ac_col2im(be, &g, l->ws, l->dx + b0 * chw));
    }
  }
  if (dx != NULL)
    *dx = l->dx;
  return AC_OK;
fail:
  return rc;
}

/* ------------------------------------------------------------------------------------ */
/* Batch normalisation                                                                     */

int ac_batchnorm_init(ac_batchnorm *l, ac_backend *be, const char *prefix, size_t c,
                      size_t hw, float eps, float momentum, size_t max_batch)
{
  int rc;
  memset(l, 0, sizeof *l);
  if (be == NULL || c == 0 || hw == 0 || max_batch == 0 || !(eps > 0.0f) ||
      !(momentum >= 0.0f && momentum <= 1.0f))
    return AC_EINVAL;
  l->be = be;
  l->c = c;
  l->hw = hw;
  l->eps = eps;
  l->momentum = momentum;
  l->max_batch = max_batch;
  size_t n = max_batch * c * hw;
  AC__TRY(ac__param_named(&l->weight, be, prefix, "weight", 1, &c));
  AC__TRY(ac__param_named(&l->bias, be, prefix, "bias", 1, &c));
  AC__TRY(ac_fill_f32(be, c, ac_tensor_f32(&l->weight.value), 1.0f));
  AC__TRY(ac_tensor_init(&l->running_mean, be, AC_F32, 1, &c));
  AC__TRY(ac_tensor_init(&l->running_var, be, AC_F32, 1, &c));
  AC__TRY(ac_fill_f32(be, c, ac_tensor_f32(&l->running_var), 1.0f));
  AC__TRY(ac__layer_alloc(be, n, &l->y));
  AC__TRY(ac__layer_alloc(be, n, &l->xhat));
  AC__TRY(ac__layer_alloc(be, n, &l->dx));
  AC__TRY(ac__layer_alloc(be, c, &l->mean));
  AC__TRY(ac__layer_alloc(be, c, &l->rstd));
  AC__TRY(ac__layer_alloc(be, c, &l->s1));
  AC__TRY(ac__layer_alloc(be, c, &l->s2));
  return AC_OK;
fail:
  ac_batchnorm_destroy(l);
  return rc;
}

void ac_batchnorm_destroy(ac_batchnorm *l)
{
  if (l->be == NULL)
    return;
  ac_param_destroy(&l->weight);
  ac_param_destroy(&l->bias);
  ac_tensor_destroy(&l->running_mean);
  ac_tensor_destroy(&l->running_var);
  float **bufs[] = {&l->y, &l->xhat, &l->dx, &l->mean, &l->rstd, &l->s1, &l->s2};
  for (size_t i = 0; i < sizeof bufs / sizeof bufs[0]; i++)
    ac__layer_free(l->be, bufs[i]);
  memset(l, 0, sizeof *l);
}

int ac_batchnorm_params(ac_batchnorm *l, ac_param_list *list)
{
  int rc = ac_param_list_push(list, &l->weight);
  return rc == AC_OK ? ac_param_list_push(list, &l->bias) : rc;
}

int ac_batchnorm_forward(ac_batchnorm *l, const float *x, size_t batch, ac_mode mode,
                         const float **y)
{
  if (l->be == NULL || x == NULL || y == NULL || batch == 0 || batch > l->max_batch ||
      (mode != AC_MODE_TRAIN && mode != AC_MODE_EVAL))
    return AC_EINVAL;
  int rc;
  ac_backend *be = l->be;
  size_t n = batch, c = l->c, hw = l->hw, m = n * hw;
  float *rmean = ac_tensor_f32(&l->running_mean), *rvar = ac_tensor_f32(&l->running_var);
  /* y holds x - mean until it is overwritten with the output. */
  if (mode == AC_MODE_TRAIN) {
    float mom = l->momentum, unbias = m > 1 ? (float)m / (float)(m - 1) : 1.0f;
    AC__TRY(ac_reduce(be, AC_REDUCE_SUM, n, c, hw, 1.0f / (float)m, x, 0.0f, l->mean));
    AC__TRY(ac_bcast(be, AC_BIN_SUB, n, c, hw, x, l->mean, l->y));
    AC__TRY(ac_reduce(be, AC_REDUCE_SUMSQ, n, c, hw, 1.0f / (float)m, l->y, 0.0f, l->s1));
    AC__TRY(ac_axpby(be, c, mom, l->mean, 1.0f - mom, rmean, rmean));
    AC__TRY(ac_axpby(be, c, mom * unbias, l->s1, 1.0f - mom, rvar, rvar));
    AC__TRY(ac_affine(be, c, 1.0f, l->s1, l->eps, l->rstd));
  } else {
    AC__TRY(ac_bcast(be, AC_BIN_SUB, n, c, hw, x, rmean, l->y));
    AC__TRY(ac_affine(be, c, 1.0f, rvar, l->eps, l->rstd));
  }
  AC__TRY(ac_unary(be, AC_UNARY_RSQRT, c, l->rstd, l->rstd));
  AC__TRY(ac_bcast(be, AC_BIN_MUL, n, c, hw, l->y, l->rstd, l->xhat));
  AC__TRY(ac_bcast(be, AC_BIN_MUL, n, c, hw, l->xhat, ac_tensor_f32(&l->weight.value), l->y));
  AC__TRY(ac_bcast(be, AC_BIN_ADD, n, c, hw, l->y, ac_tensor_f32(&l->bias.value), l->y));
  l->batch = batch;
  l->mode = mode;
  l->ready = 1;
  *y = l->y;
  return AC_OK;
fail:
  return rc;
}

int ac_batchnorm_backward(ac_batchnorm *l, const float *dy, const float **dx)
{
  if (l->be == NULL || !l->ready || dy == NULL)
    return AC_EINVAL;
  int rc;
  ac_backend *be = l->be;
  size_t n = l->batch, c = l->c, hw = l->hw, m = n * hw, total = n * c * hw;
  float inv_m = 1.0f / (float)m;
  float *s_dy = l->mean, *s_dyx = l->s2; /* per-channel sums of dy and dy xhat */
  /* One reduction each, shared by the parameter gradients and the input gradient; dx is
   * the scratch for dy xhat until it is overwritten. */
  AC__TRY(ac_reduce(be, AC_REDUCE_SUM, n, c, hw, 1.0f, dy, 0.0f, s_dy));
  AC__TRY(ac_binary(be, AC_BIN_MUL, total, dy, l->xhat, l->dx));
  AC__TRY(ac_reduce(be, AC_REDUCE_SUM, n, c, hw, 1.0f, l->dx, 0.0f, s_dyx));
  AC__TRY(ac_axpby(be, c, 1.0f, s_dy, 1.0f, ac_tensor_f32(&l->bias.grad),
                   ac_tensor_f32(&l->bias.grad)));
  AC__TRY(ac_axpby(be, c, 1.0f, s_dyx, 1.0f, ac_tensor_f32(&l->weight.grad),
                   ac_tensor_f32(&l->weight.grad)));
  if (dx == NULL)
    return AC_OK;
  /* s1 = gamma rstd per channel: the whole gradient in eval mode, where the statistics are
   * constants; training mode adds the terms through the batch mean and variance:
   * dx = gamma rstd (dy - mean(dy) - xhat mean(dy xhat)). */
  AC__TRY(ac_binary(be, AC_BIN_MUL, c, ac_tensor_f32(&l->weight.value), l->rstd, l->s1));
  if (l->mode == AC_MODE_TRAIN) {
    AC__TRY(ac_affine(be, c, inv_m, s_dy, 0.0f, s_dy));
    AC__TRY(ac_affine(be, c, inv_m, s_dyx, 0.0f, s_dyx));
    AC__TRY(ac_bcast(be, AC_BIN_MUL, n, c, hw, l->xhat, s_dyx, l->dx));
    AC__TRY(ac_binary(be, AC_BIN_SUB, total, dy, l->dx, l->dx));
    AC__TRY(ac_bcast(be, AC_BIN_SUB, n, c, hw, l->dx, s_dy, l->dx));
    AC__TRY(ac_bcast(be, AC_BIN_MUL, n, c, hw, l->dx, l->s1, l->dx));
  } else {
    AC__TRY(ac_bcast(be, AC_BIN_MUL, n, c, hw, dy, l->s1, l->dx));
  }
  *dx = l->dx;
  return AC_OK;
fail:
  return rc;
}

/* ------------------------------------------------------------------------------------ */
/* Pooling                                                                                 */

int ac_pool_init(ac_pool *l, ac_backend *be, ac_pool_op op, size_t c, size_t h, size_t w,
                 size_t k, size_t stride, size_t pad, size_t max_batch)
{
  int rc;
  memset(l, 0, sizeof *l);
  if (be == NULL || c == 0 || max_batch == 0 || (op != AC_POOL_MAX && op != AC_POOL_AVG))
    return AC_EINVAL;
  ac_conv2d_geom g = {max_batch, c, h, w, k, k, stride, stride, pad, pad};
  AC__TRY(ac_conv2d_out_hw(&g, &l->oh, &l->ow));
  l->be = be;
  l->op = op;
  l->g = g;
  size_t ny = max_batch * c * l->oh * l->ow;
  AC__TRY(ac__layer_alloc(be, ny, &l->y));
  AC__TRY(ac__layer_alloc(be, max_batch * c * h * w, &l->dx));
  if (op == AC_POOL_MAX) {
    void *p = NULL;
    AC__TRY(ac_malloc(be, ny * sizeof(int32_t), &p));
    l->argmax = p;
  }
  return AC_OK;
fail:
  ac_pool_destroy(l);
  return rc;
}

void ac_pool_destroy(ac_pool *l)
{
  if (l->be == NULL)
    return;
  ac__layer_free(l->be, &l->y);
  ac__layer_free(l->be, &l->dx);
  if (l->argmax != NULL)
    ac_free(l->be, l->argmax);
  memset(l, 0, sizeof *l);
}

int ac_pool_forward(ac_pool *l, const float *x, size_t batch, const float **y)
{
  if (l->be == NULL || x == NULL || y == NULL || batch == 0 || batch > l->g.n)
    return AC_EINVAL;
  ac_conv2d_geom g = l->g;
  g.n = batch;
  int rc = ac_pool2d_forward(l->be, l->op, &g, x, l->y, l->argmax);
  if (rc != AC_OK)
    return rc;
  l->batch = batch;
  l->ready = 1;
  *y = l->y;
  return AC_OK;
}

int ac_pool_backward(ac_pool *l, const float *dy, const float **dx)
{
  if (l->be == NULL || !l->ready || dy == NULL)
    return AC_EINVAL;
  if (dx == NULL)
    return AC_OK;
  ac_conv2d_geom g = l->g;
  g.n = l->batch;
  int rc = ac_pool2d_backward(l->be, l->op, &g, dy, l->argmax, l->dx);
  if (rc == AC_OK)
    *dx = l->dx;
  return rc;
}

/* ------------------------------------------------------------------------------------ */
/* Global average pooling                                                                  */

int ac_gap_init(ac_gap *l, ac_backend *be, size_t c, size_t hw, size_t max_batch)
{
  int rc;
  memset(l, 0, sizeof *l);
  if (be == NULL || c == 0 || hw == 0 || max_batch == 0)
    return AC_EINVAL;
  l->be = be;
  l->c = c;
  l->hw = hw;
  l->max_batch = max_batch;
  AC__TRY(ac__layer_alloc(be, max_batch * c, &l->y));
  AC__TRY(ac__layer_alloc(be, max_batch * c * hw, &l->dx));
  return AC_OK;
fail:
  ac_gap_destroy(l);
  return rc;
}

void ac_gap_destroy(ac_gap *l)
{
  if (l->be == NULL)
    return;
  ac__layer_free(l->be, &l->y);
  ac__layer_free(l->be, &l->dx);
  memset(l, 0, sizeof *l);
}

int ac_gap_forward(ac_gap *l, const float *x, size_t batch, const float **y)
{
  if (l->be == NULL || x == NULL || y == NULL || batch == 0 || batch > l->max_batch)
    return AC_EINVAL;
  int rc = ac_reduce(l->be, AC_REDUCE_SUM, 1, batch * l->c, l->hw, 1.0f / (float)l->hw, x,
                     0.0f, l->y);
  if (rc != AC_OK)
    return rc;
  l->batch = batch;
  l->ready = 1;
  *y = l->y;
  return AC_OK;
}

int ac_gap_backward(ac_gap *l, const float *dy, const float **dx)
{
  if (l->be == NULL || !l->ready || dy == NULL)
    return AC_EINVAL;
  if (dx == NULL)
    return AC_OK;
  int rc;
  size_t nc = l->batch * l->c;
  AC__TRY(ac_fill_f32(l->be, nc * l->hw, l->dx, 1.0f / (float)l->hw));
  AC__TRY(ac_bcast(l->be, AC_BIN_MUL, 1, nc, l->hw, l->dx, dy, l->dx));
  *dx = l->dx;
  return AC_OK;
fail:
  return rc;
}
