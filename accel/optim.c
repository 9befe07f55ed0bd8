/*
 * optim.c -- what every optimizer shares (the parameter-list and option checks, zeroed
 * state buffers, momentum) and gradient clipping by global norm.
 */
#include <math.h>
#include <stddef.h>

#include "optim_internal.h"

int ac__optim_in_range(double x, double lo, double hi) {
  return x >= lo && x < hi; /* false for NaN */
}

int ac__optim_lr_ok(float lr) {
  return lr >= 0.0f && isfinite(lr);
}

int ac__optim_momentum_opts_ok(float momentum, int nesterov, float weight_decay) {
  return ac__optim_in_range(momentum, 0.0, 1.0) && (nesterov == 0 || nesterov == 1) &&
         !(nesterov && momentum == 0.0f) && weight_decay >= 0.0f && isfinite(weight_decay);
}

int ac__optim_zeros(ac_backend *be, size_t n, float **out) {
  int rc = ac_malloc(be, n * sizeof(float), (void **)out);
  return rc == AC_OK ? ac_fill_f32(be, n, *out, 0.0f) : rc;
}

int ac__optim_momentum(ac_backend *be, size_t n, float mu, int nesterov, const float *d, float *buf,
                       float *out, const float **u) {
  int rc = ac_axpby(be, n, 1.0f, d, mu, buf, buf);
  *u = buf;
  if (rc == AC_OK && nesterov) {
    rc = ac_axpby(be, n, mu, buf, 1.0f, d, out);
    *u = out;
  }
  return rc;
}

int ac__optim_params_check(ac_param *const *params, size_t nparams, ac_backend **be,
                           size_t *max_numel) {
  ac_backend *first = NULL;
  size_t max = 0;

  if (params == NULL || nparams == 0) return AC_EINVAL;
  for (size_t i = 0; i < nparams; i++) {
    const ac_param *p = params[i];
    if (p == NULL || p->value.be == NULL || p->grad.be == NULL || p->value.dtype != AC_F32 ||
        p->grad.dtype != AC_F32)
      return AC_EINVAL;
    if (p->value.numel != p->grad.numel) return AC_EMISMATCH;
    if (first == NULL) first = p->value.be;
    if (p->value.be != first || p->grad.be != first) return AC_EMISMATCH;
    if (p->value.numel > max) max = p->value.numel;
  }
  if (be != NULL) *be = first;
  if (max_numel != NULL) *max_numel = max;
  return AC_OK;
}

/* AC_OK if no parameter (or parameter storage) appears twice in the list, else AC_EINVAL. */
static int params_distinct(ac_param *const *params, size_t nparams) {
  for (size_t i = 1; i < nparams; i++)
    for (size_t j = 0; j < i; j++)
      if (params[i] == params[j] ||
          (params[i]->value.data != NULL && params[i]->value.data == params[j]->value.data))
        return AC_EINVAL;
  return AC_OK;
}

int ac__optim_params_usable(ac_param *const *params, size_t nparams, ac_backend **be,
                            size_t *max_numel) {
  int rc = ac__optim_params_check(params, nparams, be, max_numel);
  return rc == AC_OK ? params_distinct(params, nparams) : rc;
}

/* ------------------------------------------------------------------------------------ */
/* Gradient clipping                                                                       */

int ac_clip_grad_norm(ac_param *const *params, size_t nparams, double max_norm, double *norm) {
  ac_backend *be = NULL;
  double total = 0.0;
  int rc = ac__optim_params_check(params, nparams, &be, NULL);

  if (rc != AC_OK) return rc;
  if (!(max_norm > 0.0)) return AC_EINVAL;

  for (size_t i = 0; i < nparams; i++) {
    double sq = 0.0;
    rc = ac_sumsq_to_host(be, params[i]->grad.numel, ac_tensor_f32(&params[i]->grad), &sq);
    if (rc != AC_OK) return rc;
    total += sq;
  }
  total = sqrt(total);
  if (norm != NULL) *norm = total;
  /* A non-finite norm carries no usable scale: leave the grads for the caller to judge. */
  if (!isfinite(total) || total <= max_norm) return AC_OK;

  const float scale = (float)(max_norm / total);
  for (size_t i = 0; i < nparams; i++) {
    float *g = ac_tensor_f32(&params[i]->grad);
    rc = ac_axpby(be, params[i]->grad.numel, scale, g, 0.0f, NULL, g);
    if (rc != AC_OK) return rc;
  }
  return AC_OK;
}
