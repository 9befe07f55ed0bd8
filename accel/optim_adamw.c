/*
 * optim_adamw.c -- AdamW (Loshchilov and Hutter, "Decoupled Weight Decay Regularization"):
 * Adam's bias-corrected moments with the weight decay applied to the parameter directly,
 * not through the gradient. The arithmetic is the backend's fused ac_adamw_update.
 */
#include <math.h>
#include <stdlib.h>

#include "optim_internal.h"

struct ac_adamw {
  ac_backend *be;
  ac_adamw_opts opts;
  size_t nparams;
  ac_param **params; /* not owned */
  float **m, **v;    /* moments per parameter */
  long steps;
};

void ac_adamw_opts_default(ac_adamw_opts *opts) {
  if (opts == NULL) return;
  opts->beta1 = 0.9f;
  opts->beta2 = 0.999f;
  opts->eps = 1e-8f;
  opts->weight_decay = 0.01f;
}

static int adamw_opts_check(const ac_adamw_opts *o) {
  if (!ac__optim_in_range(o->beta1, 0.0, 1.0) || !ac__optim_in_range(o->beta2, 0.0, 1.0) ||
      !(o->eps > 0.0f) || !isfinite(o->eps) || !(o->weight_decay >= 0.0f) ||
      !isfinite(o->weight_decay))
    return AC_EINVAL;
  return AC_OK;
}

void ac_adamw_destroy(ac_adamw *opt) {
  if (opt == NULL) return;
  for (size_t i = 0; i < opt->nparams; i++) {
    if (opt->m != NULL) ac_free(opt->be, opt->m[i]);
    if (opt->v != NULL) ac_free(opt->be, opt->v[i]);
  }
  free(opt->m);
  free(opt->v);
  free(opt->params);
  free(opt);
}

int ac_adamw_create(ac_adamw **out, ac_param *const *params, size_t nparams,
                    const ac_adamw_opts *opts) {
  ac_adamw_opts defaults;
  ac_backend *be = NULL;
  ac_adamw *opt = NULL;
  int rc;

  if (out == NULL) return AC_EINVAL;
  *out = NULL;
  if (opts == NULL) {
    ac_adamw_opts_default(&defaults);
    opts = &defaults;
  }
  rc = ac__optim_params_usable(params, nparams, &be, NULL);
  if (rc != AC_OK) return rc;
  if (adamw_opts_check(opts) != AC_OK) return AC_EINVAL;

  rc = AC_ENOMEM;
  opt = calloc(1, sizeof *opt);
  if (opt == NULL) goto fail;
  opt->be = be;
  opt->opts = *opts;
  opt->nparams = nparams;
  opt->params = calloc(nparams, sizeof *opt->params);
  opt->m = calloc(nparams, sizeof *opt->m);
  opt->v = calloc(nparams, sizeof *opt->v);
  if (opt->params == NULL || opt->m == NULL || opt->v == NULL) goto fail;
  for (size_t i = 0; i < nparams; i++) {
    size_t n = params[i]->value.numel;
    opt->params[i] = params[i];
    rc = ac__optim_zeros(be, n, &opt->m[i]);
    if (rc == AC_OK) rc = ac__optim_zeros(be, n, &opt->v[i]);
    if (rc != AC_OK) goto fail;
  }
  *out = opt;
  return AC_OK;

fail:
  ac_adamw_destroy(opt);
  return rc;
}

int ac_adamw_step(ac_adamw *opt, float lr) {
  if (opt == NULL || !ac__optim_lr_ok(lr)) return AC_EINVAL;
  const ac_adamw_args args = {
      .lr = lr,
      .beta1 = opt->opts.beta1,
      .beta2 = opt->opts.beta2,
      .eps = opt->opts.eps,
      .weight_decay = opt->opts.weight_decay,
      .step = opt->steps + 1,
  };
  for (size_t i = 0; i < opt->nparams; i++) {
    ac_param *p = opt->params[i];
    int rc = ac_adamw_update(opt->be, p->value.numel, ac_tensor_f32(&p->value),
                             ac_tensor_f32(&p->grad), opt->m[i], opt->v[i], &args);
    if (rc != AC_OK) return rc;
  }
  opt->steps++;
  return AC_OK;
}

long ac_adamw_steps(const ac_adamw *opt) {
  return opt != NULL ? opt->steps : 0;
}
