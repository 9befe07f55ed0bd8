/*
 * optim_sgd.c -- SGD with momentum (heavy ball, or Nesterov's lookahead in the form of
 * Sutskever et al. 2013) and L2 weight decay coupled into the gradient, as classic SGD has it.
 */
#include <math.h>
#include <stdlib.h>

#include "optim_internal.h"

struct ac_sgd {
  ac_backend *be;
  ac_sgd_opts opts;
  size_t nparams;
  ac_param **params; /* not owned */
  float **buf;       /* momentum buffer per parameter; NULL entries when momentum is 0 */
  float *scratch;    /* max numel: g + wd p, and the Nesterov direction */
  long steps;
};

void ac_sgd_opts_default(ac_sgd_opts *opts) {
  if (opts == NULL) return;
  opts->momentum = 0.9f;
  opts->nesterov = 0;
  opts->weight_decay = 0.0f;
}

static int sgd_opts_check(const ac_sgd_opts *o) {
  return ac__optim_momentum_opts_ok(o->momentum, o->nesterov, o->weight_decay) ? AC_OK : AC_EINVAL;
}

void ac_sgd_destroy(ac_sgd *opt) {
  if (opt == NULL) return;
  if (opt->buf != NULL)
    for (size_t i = 0; i < opt->nparams; i++) ac_free(opt->be, opt->buf[i]);
  ac_free(opt->be, opt->scratch);
  free(opt->buf);
  free(opt->params);
  free(opt);
}

int ac_sgd_create(ac_sgd **out, ac_param *const *params, size_t nparams, const ac_sgd_opts *opts) {
  ac_sgd_opts defaults;
  ac_backend *be = NULL;
  size_t max_numel = 0;
  ac_sgd *opt = NULL;
  int rc;

  if (out == NULL) return AC_EINVAL;
  *out = NULL;
  if (opts == NULL) {
    ac_sgd_opts_default(&defaults);
    opts = &defaults;
  }
  rc = ac__optim_params_usable(params, nparams, &be, &max_numel);
  if (rc != AC_OK) return rc;
  if (sgd_opts_check(opts) != AC_OK) return AC_EINVAL;

  rc = AC_ENOMEM;
  opt = calloc(1, sizeof *opt);
  if (opt == NULL) goto fail;
  opt->be = be;
  opt->opts = *opts;
  opt->nparams = nparams;
  opt->params = calloc(nparams, sizeof *opt->params);
  opt->buf = calloc(nparams, sizeof *opt->buf);
  if (opt->params == NULL || opt->buf == NULL) goto fail;
  for (size_t i = 0; i < nparams; i++) {
    opt->params[i] = params[i];
    if (opts->momentum > 0.0f) {
      rc = ac__optim_zeros(be, params[i]->value.numel, &opt->buf[i]);
      if (rc != AC_OK) goto fail;
    }
  }
  rc = ac_malloc(be, max_numel * sizeof(float), (void **)&opt->scratch);
  if (rc != AC_OK) goto fail;
  *out = opt;
  return AC_OK;

fail:
  ac_sgd_destroy(opt);
  return rc;
}

/* One parameter: d = g + wd p; buf = mu buf + d; d = nesterov ? d + mu buf : buf;
 * p -= lr d. */
static int sgd_update(ac_backend *be, size_t n, float *p, const float *g, float *buf,
                      float *scratch, const ac_sgd_opts *o, float lr) {
  const float *d = g;
  int rc = AC_OK;

  if (o->weight_decay > 0.0f) {
    rc = ac_axpby(be, n, o->weight_decay, p, 1.0f, g, scratch);
    d = scratch;
  }
  if (rc == AC_OK && buf != NULL)
    rc = ac__optim_momentum(be, n, o->momentum, o->nesterov, d, buf, scratch, &d);
  if (rc == AC_OK) rc = ac_axpby(be, n, -lr, d, 1.0f, p, p);
  return rc;
}

int ac_sgd_step(ac_sgd *opt, float lr) {
  if (opt == NULL || !ac__optim_lr_ok(lr)) return AC_EINVAL;
  for (size_t i = 0; i < opt->nparams; i++) {
    ac_param *p = opt->params[i];
    int rc = sgd_update(opt->be, p->value.numel, ac_tensor_f32(&p->value), ac_tensor_f32(&p->grad),
                        opt->buf[i], opt->scratch, &opt->opts, lr);
    if (rc != AC_OK) return rc;
  }
  opt->steps++;
  return AC_OK;
}

long ac_sgd_steps(const ac_sgd *opt) {
  return opt != NULL ? opt->steps : 0;
}
