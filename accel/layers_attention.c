/*
 * layers_attention.c -- causal multi-head self-attention with its input (qkv) and output
 * projections, written against the primitives of accel.h. Shapes, per batch of B sequences
 * of T tokens with H heads of Dh = D / H values:
 *
 *   qkv  = x Wqkv^T + b             (B, T, 3, H, Dh)   ac_linear
 *   qkvp = permute(qkv)             (3, B, H, T, Dh)   heads become batch entries
 *   P    = softmax(mask(Q K^T / sqrt(Dh)))  (B H, T, T)
 *   ctx  = P V                      (B, H, T, Dh)
 *   ctxp = permute(ctx)             (B, T, H, Dh) = (B T, D)
 *   y    = ctxp Wproj^T + b         ac_linear
 */
#include <math.h>
#include <string.h>

#include "layers_internal.h"

int ac_attention_init(ac_attention *l, ac_backend *be, const char *prefix, size_t dim,
                      size_t heads, size_t max_t, size_t max_batch, uint64_t seed)
{
  int rc;
  char name[256];
  memset(l, 0, sizeof *l);
  if (be == NULL || dim == 0 || heads == 0 || dim % heads != 0 || max_t == 0 ||
      max_batch == 0)
    return AC_EINVAL;
  l->be = be;
  l->dim = dim;
  l->heads = heads;
  l->max_t = max_t;
  l->max_batch = max_batch;
  size_t rows = max_batch * max_t, n = rows * dim, nprob = max_batch * heads * max_t * max_t;
  AC__TRY(ac__join_name(name, sizeof name, prefix, "qkv"));
  AC__TRY(ac_linear_init(&l->qkv, be, name, dim, 3 * dim, 1, rows, ac__sub_seed(seed, 0)));
  AC__TRY(ac__join_name(name, sizeof name, prefix, "proj"));
  AC__TRY(ac_linear_init(&l->proj, be, name, dim, dim, 1, rows, ac__sub_seed(seed, 1)));
  AC__TRY(ac__layer_alloc(be, 3 * n, &l->qkvp));
  AC__TRY(ac__layer_alloc(be, nprob, &l->probs));
  AC__TRY(ac__layer_alloc(be, n, &l->ctx));
  AC__TRY(ac__layer_alloc(be, n, &l->ctxp));
  AC__TRY(ac__layer_alloc(be, n, &l->dctx));
  AC__TRY(ac__layer_alloc(be, nprob, &l->dprobs));
  AC__TRY(ac__layer_alloc(be, 3 * n, &l->dqkvp));
  AC__TRY(ac__layer_alloc(be, 3 * n, &l->dqkv));
  return AC_OK;
fail:
  ac_attention_destroy(l);
  return rc;
}

void ac_attention_destroy(ac_attention *l)
{
  if (l->be == NULL)
    return;
  ac_linear_destroy(&l->qkv);
  ac_linear_destroy(&l->proj);
  float **bufs[] = {&l->qkvp, &l->probs,  &l->ctx,   &l->ctxp,
                    &l->dctx, &l->dprobs, &l->dqkvp, &l->dqkv};
  for (size_t i = 0; i < sizeof bufs / sizeof bufs[0]; i++)
    ac__layer_free(l->be, bufs[i]);
  memset(l, 0, sizeof *l);
}

int ac_attention_params(ac_attention *l, ac_param_list *list)
{
  int rc = ac_linear_params(&l->qkv, list);
  return rc == AC_OK ? ac_linear_params(&l->proj, list) : rc;
}

int ac_attention_forward(ac_attention *l, const float *x, size_t batch, size_t t,
                         const float **y)
{
  if (l->be == NULL || x == NULL || y == NULL || batch == 0 || batch > l->max_batch ||
      t == 0 || t > l->max_t)
    return AC_EINVAL;
  int rc;
  ac_backend *be = l->be;
  size_t h = l->heads, dh = l->dim / h, bh = batch * h, tdh = t * dh, tt = t * t;
  size_t sec = batch * t * l->dim; /* one of Q, K, V in qkvp */
  float scale = 1.0f / sqrtf((float)dh);
  const float *qkv, *q = l->qkvp, *k = l->qkvp + sec, *v = l->qkvp + 2 * sec;
  size_t shape5[5] = {batch, t, 3, h, dh};
  static const int to_heads[5] = {2, 0, 3, 1, 4};
  size_t shape4[4] = {batch, h, t, dh};
  static const int to_tokens[4] = {0, 2, 1, 3};

  AC__TRY(ac_linear_forward(&l->qkv, x, batch * t, &qkv));
  AC__TRY(ac_permute(be, 5, shape5, to_heads, qkv, l->qkvp));
  AC__TRY(ac_sgemm_batched(be, AC_NO_TRANS, AC_TRANS, t, t, dh, scale, q, dh, tdh, k, dh, tdh,
                           0.0f, l->probs, t, tt, bh));
  AC__TRY(ac_mask_causal(be, bh, t, l->probs, -INFINITY));
  AC__TRY(ac_softmax_rows(be, bh * t, t, l->probs, l->probs));
  AC__TRY(ac_sgemm_batched(be, AC_NO_TRANS, AC_NO_TRANS, t, dh, t, 1.0f, l->probs, t, tt, v,
                           dh, tdh, 0.0f, l->ctx, dh, tdh, bh));
  AC__TRY(ac_permute(be, 4, shape4, to_tokens, l->ctx, l->ctxp));
  AC__TRY(ac_linear_forward(&l->proj, l->ctxp, batch * t, y));
  l->batch = batch;
  l->t = t;
  l->ready = 1;
  return AC_OK;
fail:
  return rc;
}

int ac_attention_backward(ac_attention *l, const float *dy, const float **dx)
{
  if (l->be == NULL || !l->ready || dy == NULL)
    return AC_EINVAL;
  int rc;
  ac_backend *be = l->be;
  size_t batch = l->batch, t = l->t, h = l->heads, dh = l->dim / h;
  size_t bh = batch * h, tdh = t * dh, tt = t * t, sec = batch * t * l->dim;
  float scale = 1.0f / sqrtf((float)dh);
  const float *q = l->qkvp, *k = l->qkvp + sec, *v = l->qkvp + 2 * sec, *dctxp;
  float *dq = l->dqkvp, *dk = l->dqkvp + sec, *dv = l->dqkvp + 2 * sec;
  size_t shape4[4] = {batch, t, h, dh};
  static const int to_heads4[4] = {0, 2, 1, 3};
  size_t shape5[5] = {3, batch, h, t, dh};
  static const int to_tokens5[5] = {1, 3, 0, 2, 4};

  AC__TRY(ac_linear_backward(&l->proj, dy, &dctxp));
  AC__TRY(ac_permute(be, 4, shape4, to_heads4, dctxp, l->dctx));
  /* dV = P^T dctx; dP = dctx V^T; dS = softmax'(dP); dQ = s dS K; dK = s dS^T Q. */
  AC__TRY(ac_sgemm_batched(be, AC_TRANS, AC_NO_TRANS, t, dh, t, 1.0f, l->probs, t, tt,
                           l->dctx, dh, tdh, 0.0f, dv, dh, tdh, bh));
  AC__TRY(ac_sgemm_batched(be, AC_NO_TRANS, AC_TRANS, t, t, dh, 1.0f, l->dctx, dh, tdh, v, dh,
                           tdh, 0.0f, l->dprobs, t, tt, bh));
  AC__TRY(ac_softmax_rows_backward(be, bh * t, t, l->probs, l->dprobs, l->dprobs));
  AC__TRY(ac_sgemm_batched(be, AC_NO_TRANS, AC_NO_TRANS, t, dh, t, scale, l->dprobs, t, tt, k,
                           dh, tdh, 0.0f, dq, dh, tdh, bh));
  AC__TRY(ac_sgemm_batched(be, AC_TRANS, AC_NO_TRANS, t, dh, t, scale, l->dprobs, t, tt, q,
                           dh, tdh, 0.0f, dk, dh, tdh, bh));
  AC__TRY(ac_permute(be, 5, shape5, to_tokens5, l->dqkvp, l->dqkv));
  AC__TRY(ac_linear_backward(&l->qkv, l->dqkv, dx));
  return AC_OK;
fail:
  return rc;
}
