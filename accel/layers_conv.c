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

/* A chunk's column matrix (in_c k k rows, chunk oh ow columns) followed by its products in
 * (out_c, chunk, oh ow) order, before (forward) or after (backward) the permute that gives
 * NCHW. */
size_t ac_conv2d_workspace_floats(size_t in_c, size_t out_c, size_t k, size_t oh, size_t ow,
                                  size_t chunk) {
  return chunk * oh * ow * (in_c * k * k + out_c);
}

int ac_conv2d_init(ac_conv2d *l, ac_backend *be, const char *prefix, size_t in_c, size_t out_c,
                   size_t h, size_t w, size_t k, size_t stride, size_t pad, int bias,
                   size_t max_batch, size_t chunk, float *workspace, uint64_t seed) {
  int rc;
  memset(l, 0, sizeof *l);
  if (be == NULL || in_c == 0 || out_c == 0 || max_batch == 0) return AC_EINVAL;
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
  if (l->has_bias) AC__TRY(ac__param_named(&l->bias, be, prefix, "bias", 1, &out_c));
  AC__TRY(ac_rand_normal(be, seed, 0, out_c * ckk, 0.0f, sqrtf(2.0f / (float)ckk),
                         ac_tensor_f32(&l->weight.value)));
  if (workspace != NULL) {
    l->ws = workspace;
  } else {
    AC__TRY(ac__layer_alloc(be, ac_conv2d_workspace_floats(in_c, out_c, k, l->oh, l->ow, l->chunk),
                            &l->ws));
    l->owns_ws = 1;
  }
  AC__TRY(ac__layer_alloc(be, max_batch * out_c * l->oh * l->ow, &l->y));
  AC__TRY(ac__layer_alloc(be, max_batch * in_c * h * w, &l->dx));
  /* The backend's direct 3x3 kernels where it has them: forward and dW, and the input
   * gradient (a conv with in_c output channels) when they cover that too. */
  l->direct = k == 3 && stride == 1 && pad == 1 && ac_conv3x3_supported(be, in_c, out_c);
  l->direct_dx = l->direct && ac_conv3x3_supported(be, out_c, in_c);
  l->direct_s2 = stride == 2 && ((k == 3 && pad == 1) || (k == 1 && pad == 0)) &&
                 ac_conv_s2_supported(be, in_c, out_c, h, w, k);
  l->dx_as_conv = stride == 1 && (out_c * k * k + in_c) * h * w <= (ckk + out_c) * l->oh * l->ow;
  if (l->direct_dx || l->dx_as_conv)
    AC__TRY(ac__layer_alloc(be, 2 * in_c * out_c * k * k, &l->wflip));
  return AC_OK;
fail:
  ac_conv2d_destroy(l);
  return rc;
}

void ac_conv2d_destroy(ac_conv2d *l) {
  if (l->be == NULL) return;
  ac_param_destroy(&l->weight);
  ac_param_destroy(&l->bias);
  if (l->owns_ws) ac__layer_free(l->be, &l->ws);
  ac__layer_free(l->be, &l->y);
  ac__layer_free(l->be, &l->dx);
  ac__layer_free(l->be, &l->wflip);
  ac__layer_free(l->be, &l->moments);
  memset(l, 0, sizeof *l);
}

int ac_conv2d_want_moments(ac_conv2d *l) {
  if (l->be == NULL) return AC_EINVAL;
  if (l->moments == NULL) {
    int rc = ac__layer_alloc(l->be, 2 * l->out_c, &l->moments);
    if (rc != AC_OK) return rc;
  }
  l->want_moments = 1;
  return AC_OK;
}

const float *ac_conv2d_moments(const ac_conv2d *l) {
  return l->be != NULL && l->ready && l->moments_ready ? l->moments : NULL;
}

int ac_conv2d_params(ac_conv2d *l, ac_param_list *list) {
  int rc = ac_param_list_push(list, &l->weight);
  if (rc == AC_OK && l->has_bias) rc = ac_param_list_push(list, &l->bias);
  return rc;
}

/* Products of a chunk of nb images in (oc, nb, ohw) order <-> NCHW (nb, oc, ohw): the
 * permute of ac_im2col_batch's recipe. to_nchw 0 goes the other way (dy into gemm order). */
static int conv_reorder(ac_backend *be, size_t oc, size_t nb, size_t ohw, const float *src,
                        float *dst, int to_nchw) {
  const size_t shape_gemm[3] = {oc, nb, ohw}, shape_nchw[3] = {nb, oc, ohw};
  const int swap[3] = {1, 0, 2};
  return ac_permute(be, 3, to_nchw ? shape_gemm : shape_nchw, swap, src, dst);
}

/* Each chunk of images is one im2col and ONE gemm with N = chunk*ohw (not one small gemm
 * per image: 16 output channels make M short, so a long N is what keeps the gemm near its
 * peak and lets OpenBLAS use its threads). */
int ac_conv2d_forward(ac_conv2d *l, const float *x, size_t batch, const float **y) {
  if (l->be == NULL || x == NULL || y == NULL || batch == 0 || batch > l->g.n) return AC_EINVAL;
  int rc;
  ac_backend *be = l->be;
  size_t ckk = l->g.c * l->g.kh * l->g.kw, ohw = l->oh * l->ow, oc = l->out_c;
  size_t chw = l->g.c * l->g.h * l->g.w;
  const float *w = ac_tensor_f32(&l->weight.value);
  /* The moments come with the direct kernels' output, before any bias. */
  float *mom = l->want_moments && !l->has_bias ? l->moments : NULL;
  l->moments_ready = 0;
  if (l->direct && mom != NULL)
    AC__TRY(ac_conv3x3_moments(be, batch, l->g.c, oc, l->g.h, l->g.w, x, w, l->y, mom));
  else if (l->direct)
    AC__TRY(ac_conv3x3(be, batch, l->g.c, oc, l->g.h, l->g.w, x, w, l->y));
  if (l->direct_s2 && mom != NULL)
    AC__TRY(ac_conv_s2_moments(be, batch, l->g.c, oc, l->g.h, l->g.w, l->g.kh, x, w, l->y, mom));
  else if (l->direct_s2)
    AC__TRY(ac_conv_s2(be, batch, l->g.c, oc, l->g.h, l->g.w, l->g.kh, x, w, l->y));
  for (size_t b0 = 0; b0 < batch && !l->direct && !l->direct_s2; b0 += l->chunk) {
    ac_conv2d_geom g = l->g;
    g.n = batch - b0 < l->chunk ? batch - b0 : l->chunk;
    size_t cols = g.n * ohw;
    float *col = l->ws, *prod = l->ws + ckk * cols, *yc = l->y + b0 * oc * ohw;
    AC__TRY(ac_im2col_batch(be, &g, x + b0 * chw, col));
    /* One image is already NCHW: no permute. */
    AC__TRY(ac_sgemm(be, AC_NO_TRANS, AC_NO_TRANS, oc, cols, ckk, 1.0f, w, ckk, col, cols, 0.0f,
                     g.n == 1 ? yc : prod, cols));
    if (g.n > 1) AC__TRY(conv_reorder(be, oc, g.n, ohw, prod, yc, 1));
  }
  if (l->has_bias)
    AC__TRY(ac_bcast(be, AC_BIN_ADD, batch, oc, ohw, l->y, ac_tensor_f32(&l->bias.value), l->y));
  l->x = x;
  l->batch = batch;
  l->ready = 1;
  l->moments_ready = mom != NULL && (l->direct || l->direct_s2);
  *y = l->y;
  return AC_OK;
fail:
  return rc;
}

/* The weights of the input-gradient conv: wflip[ch][o][t] = W[o][ch][k k - 1 - t] (in <->
 * out channels, the k x k taps reversed), through a permute into the upper half of wflip
 * and one strided copy per tap. */
static int conv_flip_weight(ac_conv2d *l) {
  int rc;
  size_t kk = l->g.kh * l->g.kw, c = l->g.c, oc = l->out_c;
  float *perm = l->wflip + c * oc * kk;
  const size_t shape[3] = {oc, c, kk};
  const int swap[3] = {1, 0, 2};
  AC__TRY(ac_permute(l->be, 3, shape, swap, ac_tensor_f32(&l->weight.value), perm));
  for (size_t t = 0; t < kk; t++)
    AC__TRY(ac_copy2d(l->be, c * oc, 1, perm + (kk - 1 - t), kk, l->wflip + t, kk));
  return AC_OK;
fail:
  return rc;
}

/* dx of images [b0, b0 + nb) for a stride-1 conv: dx[ch][y][x] = sum over o, p, q of
 * W[o][ch][p][q] dy[o][y + pad - p][x + pad - q], i.e. the conv of dy (padding k-1-pad)
 * with wflip: dy's column matrix (out_c k k, nb h w) at the start of the workspace, the
 * product (in_c, nb h w) after it, permuted to NCHW. */
static int conv_dx_direct(ac_conv2d *l, const float *dy, size_t b0, size_t nb) {
  int rc;
  ac_backend *be = l->be;
  size_t k = l->g.kh, c = l->g.c, oc = l->out_c, hw = l->g.h * l->g.w;
  size_t cols = nb * hw, rows = oc * k * k;
  ac_conv2d_geom gd = {nb, oc, l->oh, l->ow, k, k, 1, 1, k - 1 - l->g.pad_h, k - 1 - l->g.pad_w};
  float *dcol = l->ws, *prod = l->ws + rows * cols, *dxc = l->dx + b0 * c * hw;
  AC__TRY(ac_im2col_batch(be, &gd, dy + b0 * oc * l->oh * l->ow, dcol));
  AC__TRY(ac_sgemm(be, AC_NO_TRANS, AC_NO_TRANS, c, cols, rows, 1.0f, l->wflip, rows, dcol, cols,
                   0.0f, nb == 1 ? dxc : prod, cols));
  if (nb > 1) AC__TRY(conv_reorder(be, c, nb, hw, prod, dxc, 1));
  return AC_OK;
fail:
  return rc;
}

/* The input gradient (to dst, plus addend when not NULL) on the direct kernels, with bn's
 * gradient sums made in its copy-out (ac_conv3x3_bn_grad at stride 1, ac_conv_s2_dgrad_bn
 * at stride 2) where bn follows this conv's input: returns 1 when they were made (dst then
 * holds the gradient masked by bn's ReLU, and bn->gsums_for = dst), 0 when the caller is to
 * make dx itself, or an error. */
static int conv_dx_bn(ac_conv2d *l, const float *dy, const float *addend, float *dst,
                      ac_batchnorm *bn) {
  size_t c = l->g.c, h = l->g.h, w = l->g.w;
  if (bn == NULL || !bn->ready || bn->c != c || bn->hw != h * w || bn->batch != l->batch) return 0;
  ac_bn_grad_args a = {
      .mask = bn->relu ? bn->y : NULL,
      .x = bn->x,
      .center = bn->mode == AC_MODE_TRAIN ? bn->mean : ac_tensor_f32(&bn->running_mean),
      .sums = bn->gsums};
  int rc;
  if (l->direct_dx)
    rc = ac_conv3x3_bn_grad(l->be, l->batch, l->out_c, c, h, w, dy, l->wflip, addend, dst, &a);
  else if (addend != dst) /* the stride-2 scatter would overwrite an addend in place */
    rc = ac_conv_s2_dgrad_bn(l->be, l->batch, c, l->out_c, h, w, l->g.kh, dy,
                             ac_tensor_f32(&l->weight.value), addend, dst, &a);
  else
    return 0;
  if (rc == AC_ENOTSUP) return 0;
  if (rc != AC_OK) return rc;
  bn->gsums_for = dst;
  return 1;
}

/* Backward; with addend, the input gradient plus addend goes to out instead of l->dx (dx
 * then points at out): made while the direct stride-1 kernel writes it, else one more
 * pass. With bn (the batch norm whose output was this conv's input), bn's gradient sums
 * made in the same copy-out where the kernel can (conv_dx_bn). */
static int conv_backward(ac_conv2d *l, const float *dy, const float **dx, const float *addend,
                         float *out, ac_batchnorm *bn) {
  if (l->be == NULL || !l->ready || dy == NULL) return AC_EINVAL;
  int rc;
  ac_backend *be = l->be;
  size_t ckk = l->g.c * l->g.kh * l->g.kw, ohw = l->oh * l->ow, oc = l->out_c;
  size_t c = l->g.c, chw = c * l->g.h * l->g.w;
  const float *w = ac_tensor_f32(&l->weight.value);
  float *dw = ac_tensor_f32(&l->weight.grad);
  /* K-FAC's hook reads the column matrices: with a hook, dW takes the im2col path. */
  int direct_w = (l->direct || l->direct_s2) && l->hook.fn == NULL;
  int direct_x = dx != NULL && (l->direct_dx || l->direct_s2);
  if (l->has_bias)
    AC__TRY(ac_reduce(be, AC_REDUCE_SUM, l->batch, oc, ohw, 1.0f, dy, 1.0f,
                      ac_tensor_f32(&l->bias.grad)));
  if (dx != NULL && l->wflip != NULL) AC__TRY(conv_flip_weight(l));
  if (direct_w && l->direct)
    AC__TRY(ac_conv3x3_wgrad(be, l->batch, c, oc, l->g.h, l->g.w, l->x, dy, dw));
  if (direct_w && l->direct_s2)
    AC__TRY(ac_conv_s2_wgrad(be, l->batch, c, oc, l->g.h, l->g.w, l->g.kh, l->x, dy, dw));
  int fused_add = addend != NULL && direct_x && l->direct_dx, fused_bn = 0;
  if (direct_x && bn != NULL) {
    rc = conv_dx_bn(l, dy, addend, addend != NULL ? out : l->dx, bn);
    if (rc < 0) goto fail;
    fused_bn = rc;
  }
  if (fused_bn)
    ; /* made by conv_dx_bn */
  else if (fused_add)
    AC__TRY(ac_conv3x3_add(be, l->batch, oc, c, l->g.h, l->g.w, dy, l->wflip, addend, out));
  else if (direct_x && l->direct_dx)
    AC__TRY(ac_conv3x3(be, l->batch, oc, c, l->g.h, l->g.w, dy, l->wflip, l->dx));
  if (direct_x && l->direct_s2 && !fused_bn)
    AC__TRY(ac_conv_s2_dgrad(be, l->batch, c, oc, l->g.h, l->g.w, l->g.kh, dy, w, l->dx));
  int chunked_x = dx != NULL && !direct_x;
  for (size_t b0 = 0; b0 < l->batch && (!direct_w || chunked_x); b0 += l->chunk) {
    ac_conv2d_geom g = l->g;
    g.n = l->batch - b0 < l->chunk ? l->batch - b0 : l->chunk;
    size_t cols = g.n * ohw;
    float *col = l->ws, *prod = l->ws + ckk * cols;
    const float *dyc = dy + b0 * oc * ohw;
    if (chunked_x && l->dx_as_conv && direct_w) { /* dx alone */
      AC__TRY(conv_dx_direct(l, dy, b0, g.n));
      continue;
    }
    if (g.n > 1) {
      AC__TRY(conv_reorder(be, oc, g.n, ohw, dyc, prod, 0));
      dyc = prod;
    }
    if (!direct_w) {
      /* The workspace is shared, so im2col is recomputed rather than kept from forward. */
      AC__TRY(ac_im2col_batch(be, &g, l->x + b0 * chw, col));
      if (l->hook.fn != NULL) { /* before the dx product reuses col */
        ac_hook_view v = {.kind = AC_HOOK_CONV,
                          .weight = &l->weight,
                          .bias = l->has_bias ? &l->bias : NULL,
                          .batch = l->batch,
                          .first = b0,
                          .nimg = g.n,
                          .cols = cols,
                          .in = ckk,
                          .out = oc,
                          .npos = ohw,
                          .a = col,
                          .lda = cols,
                          .g = dyc,
                          .ldg = cols};
        AC__TRY(l->hook.fn(l->hook.ctx, &v));
      }
      AC__TRY(ac_sgemm(be, AC_NO_TRANS, AC_TRANS, oc, ckk, cols, 1.0f, dyc, cols, col, cols, 1.0f,
                       dw, ckk)); /* dW += dy col^T */
    }
    if (chunked_x && l->dx_as_conv) {
      AC__TRY(conv_dx_direct(l, dy, b0, g.n)); /* dyc and col are no longer needed */
    } else if (chunked_x) { /* dcol = W^T dy, then scattered back to the images */
      AC__TRY(ac_sgemm(be, AC_TRANS, AC_NO_TRANS, ckk, cols, oc, 1.0f, w, ckk, dyc, cols, 0.0f, col,
                       cols));
      AC__TRY(ac_col2im_batch(be, &g, col, l->dx + b0 * chw));
    }
  }
  if (dx != NULL && addend != NULL && !fused_add && !fused_bn)
    AC__TRY(ac_axpby(be, l->batch * chw, 1.0f, l->dx, 1.0f, addend, out));
  if (dx != NULL) *dx = addend != NULL ? out : l->dx;
  return AC_OK;
fail:
  return rc;
}

int ac_conv2d_backward(ac_conv2d *l, const float *dy, const float **dx) {
  return conv_backward(l, dy, dx, NULL, NULL, NULL);
}

int ac_conv2d_backward_add(ac_conv2d *l, const float *dy, const float *addend, float *out) {
  const float *dx;
  if (addend == NULL || out == NULL) return AC_EINVAL;
  return conv_backward(l, dy, &dx, addend, out, NULL);
}

int ac_conv2d_backward_bn(ac_conv2d *l, const float *dy, const float *addend, float *out,
                          ac_batchnorm *bn, const float **dx) {
  if (dx == NULL || (addend != NULL && out == NULL)) return AC_EINVAL;
  return conv_backward(l, dy, dx, addend, out, bn);
}

/* ------------------------------------------------------------------------------------ */
/* Batch normalisation                                                                     */

int ac_batchnorm_init(ac_batchnorm *l, ac_backend *be, const char *prefix, size_t c, size_t hw,
                      float eps, float momentum, size_t max_batch) {
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
  AC__TRY(ac__layer_alloc(be, n, &l->dx));
  AC__TRY(ac__layer_alloc(be, c, &l->mean));
  AC__TRY(ac__layer_alloc(be, c, &l->rstd));
  AC__TRY(ac__layer_alloc(be, c, &l->s1));
  AC__TRY(ac__layer_alloc(be, c, &l->s2));
  AC__TRY(ac__layer_alloc(be, 3 * c, &l->coef));
  AC__TRY(ac__layer_alloc(be, 2 * c, &l->gsums));
  return AC_OK;
fail:
  ac_batchnorm_destroy(l);
  return rc;
}

void ac_batchnorm_destroy(ac_batchnorm *l) {
  if (l->be == NULL) return;
  ac_param_destroy(&l->weight);
  ac_param_destroy(&l->bias);
  ac_tensor_destroy(&l->running_mean);
  ac_tensor_destroy(&l->running_var);
  float **bufs[] = {&l->y,  &l->dx, &l->dres, &l->mean, &l->rstd,
                    &l->s1, &l->s2, &l->coef, &l->gsums};
  for (size_t i = 0; i < sizeof bufs / sizeof bufs[0]; i++) ac__layer_free(l->be, bufs[i]);
  memset(l, 0, sizeof *l);
}

int ac_batchnorm_fuse_relu(ac_batchnorm *l) {
  if (l->be == NULL) return AC_EINVAL;
  if (l->dres == NULL) {
    int rc = ac__layer_alloc(l->be, l->max_batch * l->c * l->hw, &l->dres);
    if (rc != AC_OK) return rc;
  }
  l->relu = 1;
  return AC_OK;
}

int ac_batchnorm_xhat(ac_batchnorm *l, float *xhat) {
  if (l->be == NULL || !l->ready || xhat == NULL) return AC_EINVAL;
  int rc;
  size_t c = l->c;
  const float *center = l->mode == AC_MODE_TRAIN ? l->mean : ac_tensor_f32(&l->running_mean);
  AC__TRY(ac_binary(l->be, AC_BIN_MUL, c, center, l->rstd, l->coef));
  AC__TRY(ac_affine(l->be, c, -1.0f, l->coef, 0.0f, l->coef));
  AC__TRY(ac_channel_affine(l->be, l->batch, c, l->hw, l->x, l->rstd, l->coef, NULL, 0, xhat));
  return AC_OK;
fail:
  return rc;
}

int ac_batchnorm_params(ac_batchnorm *l, ac_param_list *list) {
  int rc = ac_param_list_push(list, &l->weight);
  return rc == AC_OK ? ac_param_list_push(list, &l->bias) : rc;
}

/* Sync BN (ac_bn_sync): the share's mean (l->mean) and biased variance (l->s2) become the
 * global batch's. With equal shares the batch's mean is the mean of the shares' means, and
 * its variance the mean over the shares of var_w + (mean_w - mean)^2: two calls, the means
 * first. (One call averaging the mean squares, var = E[x^2] - mean^2, would cancel in float
 * where a channel's mean is large against its spread.) In coef (3c floats, unused by
 * forward). */
static int ac__batchnorm_sync_moments(ac_batchnorm *l) {
  int rc;
  ac_backend *be = l->be;
  size_t c = l->c;
  float *mu = l->coef, *m2 = l->coef + c, *d = l->coef + 2 * c;
  AC__TRY(ac_memcpy_d2d(be, mu, l->mean, c * sizeof(float)));
  AC__TRY(l->sync.fn(l->sync.ctx, mu, c));
  AC__TRY(ac_binary(be, AC_BIN_SUB, c, l->mean, mu, d));
  AC__TRY(ac_binary(be, AC_BIN_MUL, c, d, d, d));
  AC__TRY(ac_axpby(be, c, 1.0f, l->s2, 1.0f, d, m2));
  AC__TRY(l->sync.fn(l->sync.ctx, m2, c));
  AC__TRY(ac_memcpy_d2d(be, l->mean, mu, c * sizeof(float)));
  AC__TRY(ac_memcpy_d2d(be, l->s2, m2, c * sizeof(float)));
  return AC_OK;
fail:
  return rc;
}

/* Per channel: rstd = 1 / sqrt(var + eps), scale s1 = gamma rstd, shift s2 = beta - mean
 * s1; the output is one ac_channel_affine pass (with the residual and ReLU folded in). */
int ac_batchnorm_forward_res(ac_batchnorm *l, const float *x, const float *res, size_t batch,
                             ac_mode mode, const float **y) {
  return ac_batchnorm_forward_moments(l, x, res, NULL, batch, mode, y);
}

int ac_batchnorm_forward_moments(ac_batchnorm *l, const float *x, const float *res,
                                 const float *moments, size_t batch, ac_mode mode,
                                 const float **y) {
  if (l->be == NULL || x == NULL || y == NULL || batch == 0 || batch > l->max_batch ||
      (mode != AC_MODE_TRAIN && mode != AC_MODE_EVAL))
    return AC_EINVAL;
  int rc;
  ac_backend *be = l->be;
  size_t n = batch, c = l->c, hw = l->hw, m = n * hw;
  float *rmean = ac_tensor_f32(&l->running_mean), *rvar = ac_tensor_f32(&l->running_var);
  const float *mean = rmean, *var = rvar;
  if (mode == AC_MODE_TRAIN) {
    size_t mt = l->sync.fn != NULL && l->sync.workers > 1 ? m * (size_t)l->sync.workers : m;
    float mom = l->momentum, unbias = mt > 1 ? (float)mt / (float)(mt - 1) : 1.0f;
    if (moments != NULL) {
      AC__TRY(ac_memcpy_d2d(be, l->mean, moments, c * sizeof(float)));
      AC__TRY(ac_memcpy_d2d(be, l->s2, moments + c, c * sizeof(float)));
    } else {
      AC__TRY(ac_channel_moments(be, n, c, hw, x, l->mean, l->s2));
    }
    if (l->sync.fn != NULL) AC__TRY(ac__batchnorm_sync_moments(l));
    AC__TRY(ac_axpby(be, c, mom, l->mean, 1.0f - mom, rmean, rmean));
    AC__TRY(ac_axpby(be, c, mom * unbias, l->s2, 1.0f - mom, rvar, rvar));
    mean = l->mean;
    var = l->s2;
  }
  AC__TRY(ac_affine(be, c, 1.0f, var, l->eps, l->rstd));
  AC__TRY(ac_unary(be, AC_UNARY_RSQRT, c, l->rstd, l->rstd));
  AC__TRY(ac_binary(be, AC_BIN_MUL, c, ac_tensor_f32(&l->weight.value), l->rstd, l->s1));
  AC__TRY(ac_binary(be, AC_BIN_MUL, c, mean, l->s1, l->s2));
  AC__TRY(ac_binary(be, AC_BIN_SUB, c, ac_tensor_f32(&l->bias.value), l->s2, l->s2));
  AC__TRY(ac_channel_affine(be, n, c, hw, x, l->s1, l->s2, res, l->relu, l->y));
  l->x = x;
  l->batch = batch;
  l->mode = mode;
  l->ready = 1;
  l->gsums_for = NULL;
  *y = l->y;
  return AC_OK;
fail:
  return rc;
}

int ac_batchnorm_forward(ac_batchnorm *l, const float *x, size_t batch, ac_mode mode,
                         const float **y) {
  return ac_batchnorm_forward_res(l, x, NULL, batch, mode, y);
}

/* With g the gradient at the normalised output (dy, masked by a fused ReLU), xhat =
 * (x - mean) rstd and k = gamma rstd: dbeta += sum g, dgamma += sum g xhat and, in training
 * mode, dx = k (g - mean(g) - xhat mean(g xhat)) = A g + B x + C per channel with A = k,
 * B = -k rstd mean(g xhat), C = -k mean(g) - B mean (in eval mode the statistics are
 * constants: dx = k g). One pass for the sums, one for dx; where the conv that made dy made
 * the sums too (ac_conv2d_backward_bn: gsums_for is dy, which comes masked), the dx pass
 * alone. */
int ac_batchnorm_backward_res(ac_batchnorm *l, const float *dy, const float **dx,
                              const float **dres) {
  if (l->be == NULL || !l->ready || dy == NULL) return AC_EINVAL;
  int rc;
  ac_backend *be = l->be;
  size_t n = l->batch, c = l->c, hw = l->hw, m = n * hw;
  float inv_m = 1.0f / (float)m;
  int train = l->mode == AC_MODE_TRAIN;
  const float *relu_y = l->relu ? l->y : NULL;
  int summed = l->gsums_for != NULL && l->gsums_for == dy;
  const float *mask = summed ? NULL : relu_y; /* a summed dy is masked already */
  const float *center = train ? l->mean : ac_tensor_f32(&l->running_mean);
  float *sum_g = summed ? l->gsums : l->s1, *sum_gx = summed ? l->gsums + c : l->s2;
  l->gsums_for = NULL;
  float *ca = l->coef, *cb = l->coef + c, *cc = l->coef + 2 * c;
  /* With a fused ReLU and the residual's gradient asked for, g is written once and both
   * the residual and the dx pass read it unmasked. */
  float *gout = mask != NULL && dres != NULL ? l->dres : NULL;
  if (l->hook.fn != NULL) { /* first: ac_batchnorm_xhat uses coef, which is free until below */
    ac_hook_view v = {.kind = AC_HOOK_BATCHNORM,
                      .weight = &l->weight,
                      .bias = &l->bias,
                      .batch = n,
                      .rows = n,
                      .in = c,
                      .out = c,
                      .npos = hw,
                      .g = dy,
                      .relu_y = relu_y,
                      .bn = l};
    AC__TRY(l->hook.fn(l->hook.ctx, &v));
  }
  if (!summed)
    AC__TRY(ac_channel_grad_sums(be, n, c, hw, dy, mask, l->x, center, gout, sum_g, sum_gx));
  AC__TRY(ac_axpby(be, c, 1.0f, sum_g, 1.0f, ac_tensor_f32(&l->bias.grad),
                   ac_tensor_f32(&l->bias.grad)));
  AC__TRY(ac_binary(be, AC_BIN_MUL, c, l->rstd, sum_gx, cc)); /* sum g xhat */
  AC__TRY(ac_axpby(be, c, 1.0f, cc, 1.0f, ac_tensor_f32(&l->weight.grad),
                   ac_tensor_f32(&l->weight.grad)));
  if (dx != NULL) {
    const float *g = gout != NULL ? gout : dy, *gmask = gout != NULL ? NULL : mask;
    if (train && l->sync.fn != NULL) {
      /* Sync BN: mean(g) and mean(g xhat) over the global batch. The workers average
       * [sum g, sum g xhat] of their equal shares, which inv_m (the share's count) then
       * turns into the batch's means; the parameter gradients above stay the share's. */
      AC__TRY(ac_memcpy_d2d(be, ca, sum_g, c * sizeof(float)));
      AC__TRY(ac_memcpy_d2d(be, cb, cc, c * sizeof(float)));
      AC__TRY(l->sync.fn(l->sync.ctx, ca, 2 * c));
      AC__TRY(ac_memcpy_d2d(be, sum_g, ca, c * sizeof(float)));
      AC__TRY(ac_memcpy_d2d(be, cc, cb, c * sizeof(float)));
    }
    AC__TRY(ac_binary(be, AC_BIN_MUL, c, ac_tensor_f32(&l->weight.value), l->rstd, ca));
    if (train) {
      AC__TRY(ac_binary(be, AC_BIN_MUL, c, ca, l->rstd, cb));
      AC__TRY(ac_binary(be, AC_BIN_MUL, c, cb, cc, cb));
      AC__TRY(ac_affine(be, c, -inv_m, cb, 0.0f, cb));         /* B */
      AC__TRY(ac_binary(be, AC_BIN_MUL, c, cb, center, cc));   /* B mean */
      AC__TRY(ac_binary(be, AC_BIN_MUL, c, ca, sum_g, sum_g)); /* k sum g */
      AC__TRY(ac_axpby(be, c, -inv_m, sum_g, -1.0f, cc, cc));  /* C */
      AC__TRY(ac_channel_combine(be, n, c, hw, g, gmask, l->x, ca, cb, cc, l->dx));
    } else {
      AC__TRY(ac_channel_combine(be, n, c, hw, g, gmask, l->x, ca, NULL, NULL, l->dx));
    }
    *dx = l->dx;
  }
  if (dres != NULL) *dres = gout != NULL ? gout : dy;
  return AC_OK;
fail:
  return rc;
}

int ac_batchnorm_backward(ac_batchnorm *l, const float *dy, const float **dx) {
  return ac_batchnorm_backward_res(l, dy, dx, NULL);
}

/* ------------------------------------------------------------------------------------ */
/* Pooling                                                                                 */

int ac_pool_init(ac_pool *l, ac_backend *be, ac_pool_op op, size_t c, size_t h, size_t w, size_t k,
                 size_t stride, size_t pad, size_t max_batch) {
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

void ac_pool_destroy(ac_pool *l) {
  if (l->be == NULL) return;
  ac__layer_free(l->be, &l->y);
  ac__layer_free(l->be, &l->dx);
  if (l->argmax != NULL) ac_free(l->be, l->argmax);
  memset(l, 0, sizeof *l);
}

int ac_pool_forward(ac_pool *l, const float *x, size_t batch, const float **y) {
  if (l->be == NULL || x == NULL || y == NULL || batch == 0 || batch > l->g.n) return AC_EINVAL;
  ac_conv2d_geom g = l->g;
  g.n = batch;
  int rc = ac_pool2d_forward(l->be, l->op, &g, x, l->y, l->argmax);
  if (rc != AC_OK) return rc;
  l->batch = batch;
  l->ready = 1;
  *y = l->y;
  return AC_OK;
}

int ac_pool_backward(ac_pool *l, const float *dy, const float **dx) {
  if (l->be == NULL || !l->ready || dy == NULL) return AC_EINVAL;
  if (dx == NULL) return AC_OK;
  ac_conv2d_geom g = l->g;
  g.n = l->batch;
  int rc = ac_pool2d_backward(l->be, l->op, &g, dy, l->argmax, l->dx);
  if (rc == AC_OK) *dx = l->dx;
  return rc;
}

/* ------------------------------------------------------------------------------------ */
/* Global average pooling                                                                  */

int ac_gap_init(ac_gap *l, ac_backend *be, size_t c, size_t hw, size_t max_batch) {
  int rc;
  memset(l, 0, sizeof *l);
  if (be == NULL || c == 0 || hw == 0 || max_batch == 0) return AC_EINVAL;
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

void ac_gap_destroy(ac_gap *l) {
  if (l->be == NULL) return;
  ac__layer_free(l->be, &l->y);
  ac__layer_free(l->be, &l->dx);
  memset(l, 0, sizeof *l);
}

int ac_gap_forward(ac_gap *l, const float *x, size_t batch, const float **y) {
  if (l->be == NULL || x == NULL || y == NULL || batch == 0 || batch > l->max_batch)
    return AC_EINVAL;
  int rc =
      ac_reduce(l->be, AC_REDUCE_SUM, 1, batch * l->c, l->hw, 1.0f / (float)l->hw, x, 0.0f, l->y);
  if (rc != AC_OK) return rc;
  l->batch = batch;
  l->ready = 1;
  *y = l->y;
  return AC_OK;
}

int ac_gap_backward(ac_gap *l, const float *dy, const float **dx) {
  if (l->be == NULL || !l->ready || dy == NULL) return AC_EINVAL;
  if (dx == NULL) return AC_OK;
  int rc;
  size_t nc = l->batch * l->c;
  AC__TRY(ac_fill_f32(l->be, nc * l->hw, l->dx, 1.0f / (float)l->hw));
  AC__TRY(ac_bcast(l->be, AC_BIN_MUL, 1, nc, l->hw, l->dx, dy, l->dx));
  *dx = l->dx;
  return AC_OK;
fail:
  return rc;
}
