/*
 * abs.c -- ABS's worker half (docs/abs.md): Hessian-vector products by central differences
 * of gradients, Hv ~ (grad(w + h v) - grad(w - h v)) / (2 h), over any model whose gradient
 * a callback computes. Two gradient evaluations and no double back-propagation: every layer's
 * backward serves as it is. The weights are put back bit for bit from a copy (w + h v - h v
 * would not round back to w in fp32).
 */
#include <math.h>
#include <string.h>

#include "accel.h"

int ac_hvp_init(ac_hvp *h, ac_param *const *params, size_t nparams) {
  if (!h) return AC_EINVAL;
  memset(h, 0, sizeof *h);
  if (!params || nparams == 0) return AC_EINVAL;
  ac_backend *be = params[0]->value.be;
  size_t numel = 0;
  for (size_t i = 0; i < nparams; i++) {
    if (!params[i] || params[i]->value.be != be || params[i]->value.dtype != AC_F32)
      return AC_EINVAL;
    numel += params[i]->value.numel;
  }
  if (numel == 0) return AC_EINVAL;
  int rc = ac_malloc(be, 2 * numel * sizeof(float), (void **)&h->w0);
  if (rc != AC_OK) return rc;
  h->gp = h->w0 + numel;
  h->be = be;
  h->params = params;
  h->nparams = nparams;
  h->numel = numel;
  return AC_OK;
}

void ac_hvp_destroy(ac_hvp *h) {
  if (!h) return;
  if (h->be) ac_free(h->be, h->w0);
  memset(h, 0, sizeof *h);
}

/* Every parameter's value to w0 + alpha v (w0 and v concatenated in parameter order), and
 * its gradient to zero. */
static int hvp_shift(ac_hvp *h, const float *v, float alpha) {
  size_t off = 0;
  for (size_t i = 0; i < h->nparams; i++) {
    ac_param *p = h->params[i];
    size_t n = p->value.numel;
    int rc = ac_axpby(h->be, n, alpha, v + off, 1.0f, h->w0 + off, ac_tensor_f32(&p->value));
    if (rc == AC_OK) rc = ac_fill_f32(h->be, n, ac_tensor_f32(&p->grad), 0.0f);
    if (rc != AC_OK) return rc;
    off += n;
  }
  return AC_OK;
}

/* dst[off..] = alpha grad + beta src[off..] over the parameters (src may be NULL with beta
 * 0: a plain copy, scaled). */
static int hvp_gather(ac_hvp *h, float alpha, float beta, const float *src, float *dst) {
  size_t off = 0;
  for (size_t i = 0; i < h->nparams; i++) {
    ac_param *p = h->params[i];
    size_t n = p->value.numel;
    int rc =
        ac_axpby(h->be, n, alpha, ac_tensor_f32(&p->grad), beta, src ? src + off : NULL, dst + off);
    if (rc != AC_OK) return rc;
    off += n;
  }
  return AC_OK;
}

/* Every parameter's value back from w0 (a copy: 0 v + w0 would turn -0 into +0) and its
 * gradient to zero. */
static int hvp_restore(ac_hvp *h) {
  size_t off = 0;
  for (size_t i = 0; i < h->nparams; i++) {
    ac_param *p = h->params[i];
    size_t n = p->value.numel;
    int rc = ac_memcpy_d2d(h->be, ac_tensor_f32(&p->value), h->w0 + off, n * sizeof(float));
    if (rc == AC_OK) rc = ac_fill_f32(h->be, n, ac_tensor_f32(&p->grad), 0.0f);
    if (rc != AC_OK) return rc;
    off += n;
  }
  return AC_OK;
}

int ac_hvp_compute(ac_hvp *h, const float *v, double rel_step, int (*grad)(void *ctx), void *ctx,
                   float *hv, double *step) {
  if (!h || !h->be || !v || !hv || !grad || !(rel_step > 0.0) || !isfinite(rel_step))
    return AC_EINVAL;
  int rc = AC_OK;
  size_t off = 0;
  double w2 = 0.0, v2 = 0.0;
  for (size_t i = 0; i < h->nparams && rc == AC_OK; i++) {
    ac_param *p = h->params[i];
    double s = 0.0;
    rc =
        ac_memcpy_d2d(h->be, h->w0 + off, ac_tensor_f32(&p->value), p->value.numel * sizeof(float));
    if (rc == AC_OK) rc = ac_sumsq_to_host(h->be, p->value.numel, h->w0 + off, &s);
    w2 += s;
    off += p->value.numel;
  }
  if (rc == AC_OK) rc = ac_sumsq_to_host(h->be, h->numel, v, &v2);
  if (rc != AC_OK) return rc;
  if (!(v2 > 0.0) || !isfinite(v2) || !isfinite(w2)) return AC_EINVAL;
  /* h moves the weights by rel_step of their norm (at least of 1) whatever v's norm. */
  double hstep = rel_step * fmax(sqrt(w2), 1.0) / sqrt(v2);
  float inv2h = (float)(0.5 / hstep);
  rc = hvp_shift(h, v, (float)hstep);
  if (rc == AC_OK) rc = grad(ctx);
  if (rc == AC_OK) rc = hvp_gather(h, 1.0f, 0.0f, NULL, h->gp);
  if (rc == AC_OK) rc = hvp_shift(h, v, (float)-hstep);
  if (rc == AC_OK) rc = grad(ctx);
  if (rc == AC_OK) rc = hvp_gather(h, -inv2h, inv2h, h->gp, hv);
  /* Put the weights back and leave no gradient behind, on success or not. */
  int rr = hvp_restore(h);
  if (rc == AC_OK) rc = rr;
  if (rc == AC_OK && step) *step = hstep;
  return rc;
}
