/*
 * layers_attention.c -- causal multi-head self-attention with its input (qkv) and output
 * projections, written against the primitives of accel.h. Per batch of B sequences of T
 * tokens, H heads of Dh = D / H values:
 *
 *   qkv = x Wqkv^T + b            (B T, 3 D): each token's row is [q | k | v], each (H, Dh)
 *   P   = softmax(mask(Q K^T / sqrt(Dh)))      (B, H, T, T)
 *   ctx = P V                     (B T, D): heads side by side, as the projection wants them
 *   y   = ctx Wproj^T + b
 *
 * The heads are read and written in place through leading dimensions (a head of sequence b
 * is a T x Dh block with row stride 3 D in qkv, D in ctx): one strided-batched gemm per
 * head over the B sequences, and no transposes of activations at all.
 */
#include <math.h>
#include <string.h>

#include "layers_internal.h"

int ac_attention_init(ac_attention *l, ac_backend *be, const char *prefix, size_t dim, size_t heads,
                      size_t max_t, size_t max_batch, uint64_t seed) {
  int rc;
  char name[256];
  memset(l, 0, sizeof *l);
  if (be == NULL || dim == 0 || heads == 0 || dim % heads != 0 || max_t == 0 || max_batch == 0)
    return AC_EINVAL;
  l->be = be;
  l->dim = dim;
  l->heads = heads;
  l->max_t = max_t;
  l->max_batch = max_batch;
  size_t rows = max_batch * max_t, nprob = max_batch * heads * max_t * max_t;
  AC__TRY(ac__join_name(name, sizeof name, prefix, "qkv"));
  AC__TRY(ac_linear_init(&l->qkv, be, name, dim, 3 * dim, 1, rows, ac__sub_seed(seed, 0)));
  AC__TRY(ac__join_name(name, sizeof name, prefix, "proj"));
  AC__TRY(ac_linear_init(&l->proj, be, name, dim, dim, 1, rows, ac__sub_seed(seed, 1)));
  AC__TRY(ac__layer_alloc(be, nprob, &l->probs));
  AC__TRY(ac__layer_alloc(be, nprob, &l->dprobs));
  AC__TRY(ac__layer_alloc(be, rows * dim, &l->ctx));
  AC__TRY(ac__layer_alloc(be, rows * 3 * dim, &l->dqkv));
  return AC_OK;
fail:
  ac_attention_destroy(l);
  return rc;
}

void ac_attention_destroy(ac_attention *l) {
  if (l->be == NULL) return;
  ac_linear_destroy(&l->qkv);
  ac_linear_destroy(&l->proj);
  float **bufs[] = {&l->probs, &l->dprobs, &l->ctx, &l->dqkv};
  for (size_t i = 0; i < sizeof bufs / sizeof bufs[0]; i++) ac__layer_free(l->be, bufs[i]);
  memset(l, 0, sizeof *l);
}

int ac_attention_params(ac_attention *l, ac_param_list *list) {
  int rc = ac_linear_params(&l->qkv, list);
  return rc == AC_OK ? ac_linear_params(&l->proj, list) : rc;
}

int ac_attention_forward(ac_attention *l, const float *x, size_t batch, size_t t, const float **y) {
  if (l->be == NULL || x == NULL || y == NULL || batch == 0 || batch > l->max_batch || t == 0 ||
      t > l->max_t)
    return AC_EINVAL;
  int rc;
  ac_backend *be = l->be;
  size_t d = l->dim, h = l->heads, dh = d / h, tt = t * t;
  size_t ld = 3 * d, seq = t * 3 * d; /* qkv: row stride, sequence stride */
  float scale = 1.0f / sqrtf((float)dh);
  const float *qkv;

  AC__TRY(ac_linear_forward(&l->qkv, x, batch * t, &qkv));
  for (size_t hd = 0; hd < h; hd++) {
    const float *q = qkv + hd * dh, *k = qkv + d + hd * dh;
    AC__TRY(ac_sgemm_batched(be, AC_NO_TRANS, AC_TRANS, t, t, dh, scale, q, ld, seq, k, ld, seq,
                             0.0f, l->probs + hd * tt, t, h * tt, batch));
  }
  AC__TRY(ac_mask_causal(be, batch * h, t, l->probs, -INFINITY));
  AC__TRY(ac_softmax_rows(be, batch * h * t, t, l->probs, l->probs));
  for (size_t hd = 0; hd < h; hd++) {
    const float *v = qkv + 2 * d + hd * dh;
    AC__TRY(ac_sgemm_batched(be, AC_NO_TRANS, AC_NO_TRANS, t, dh, t, 1.0f, l->probs + hd * tt, t,
                             h * tt, v, ld, seq, 0.0f, l->ctx + hd * dh, d, t * d, batch));
  }
  AC__TRY(ac_linear_forward(&l->proj, l->ctx, batch * t, y));
  l->batch = batch;
  l->t = t;
  l->ready = 1;
  return AC_OK;
fail:
  return rc;
}

int ac_attention_backward(ac_attention *l, const float *dy, const float **dx) {
  if (l->be == NULL || !l->ready || dy == NULL) return AC_EINVAL;
  int rc;
  ac_backend *be = l->be;
  size_t batch = l->batch, t = l->t, d = l->dim, h = l->heads, dh = d / h, tt = t * t;
  size_t ld = 3 * d, seq = t * 3 * d;
  float scale = 1.0f / sqrtf((float)dh);
  const float *qkv = l->qkv.y, *dctx;

  AC__TRY(ac_linear_backward(&l->proj, dy, &dctx));
  /* Per head: dV = P^T dctx and dP = dctx V^T; then dS = softmax'(dP) for all heads;
   * then dQ = s dS K and dK = s dS^T Q, each written into its slot of dqkv. */
  for (size_t hd = 0; hd < h; hd++) {
    const float *dc = dctx + hd * dh, *v = qkv + 2 * d + hd * dh;
    AC__TRY(ac_sgemm_batched(be, AC_TRANS, AC_NO_TRANS, t, dh, t, 1.0f, l->probs + hd * tt, t,
                             h * tt, dc, d, t * d, 0.0f, l->dqkv + 2 * d + hd * dh, ld, seq,
                             batch));
    AC__TRY(ac_sgemm_batched(be, AC_NO_TRANS, AC_TRANS, t, t, dh, 1.0f, dc, d, t * d, v, ld, seq,
                             0.0f, l->dprobs + hd * tt, t, h * tt, batch));
  }
  AC__TRY(ac_softmax_rows_backward(be, batch * h * t, t, l->probs, l->dprobs, l->dprobs));
  for (size_t hd = 0; hd < h; hd++) {
    const float *q = qkv + hd * dh, *k = qkv + d + hd * dh, *ds = l->dprobs + hd * tt;
    AC__TRY(ac_sgemm_batched(be, AC_NO_TRANS, AC_NO_TRANS, t, dh, t, scale, ds, t, h * tt, k, ld,
                             seq, 0.0f, l->dqkv + hd * dh, ld, seq, batch));
    AC__TRY(ac_sgemm_batched(be, AC_TRANS, AC_NO_TRANS, t, dh, t, scale, ds, t, h * tt, q, ld, seq,
                             0.0f, l->dqkv + d + hd * dh, ld, seq, batch));
  }
  AC__TRY(ac_linear_backward(&l->qkv, l->dqkv, dx));
  return AC_OK;
fail:
  return rc;
}
