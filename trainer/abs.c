/*
 * abs.c -- ABS's worker half (Yao et al. 2018; docs/abs.md): the top Hessian eigenvalue
 * by power iteration over central-difference Hessian-vector products (accel's ac_hvp) and
 * the adaptive-batch rule (preconditioner's pc_abs_rule), once per epoch.
 *
 * The power iteration is driven one product at a time (pc_abs_power_step), the form the
 * daemon will hold it in: the probe goes host -> device, the product device -> host.
 */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "trainer_internal.h"

struct pt_abs {
  ac_backend *be;
  pc_abs_opts opts;
  pc_abs_rule rule;
  ac_hvp hvp;
  float *v, *hv;     /* host: the probe and its product (numel each) */
  float *d_v, *d_hv; /* device */
  uint64_t estimates;
};

void pt_abs_destroy(pt_abs *a) {
  if (!a) return;
  if (a->be) {
    ac_free(a->be, a->d_v);
    ac_free(a->be, a->d_hv);
  }
  ac_hvp_destroy(&a->hvp);
  free(a->v);
  free(a->hv);
  free(a);
}

int pt_abs_create(pt_abs **out, ac_param *const *params, size_t nparams, const pc_abs_opts *opts,
                  pt_error *err) {
  if (!out) return pt__fail(err, PT_EINVAL, "pt_abs_create: NULL out");
  *out = NULL;
  if (!params || nparams == 0 || pc_abs_opts_check(opts) != PC_OK)
    return pt__fail(err, PT_EINVAL, "pt_abs_create: no parameters, or options out of range");
  pt_abs *a = calloc(1, sizeof *a);
  if (!a) return pt__fail(err, PT_ENOMEM, "ABS: out of memory");
  a->opts = *opts;
  pc_abs_rule_init(&a->rule, opts);
  int rc = pt__accel(err, ac_hvp_init(&a->hvp, params, nparams), "ABS: ac_hvp_init");
  if (rc != PT_OK) goto fail;
  a->be = a->hvp.be;
  size_t n = a->hvp.numel;
  a->v = malloc(n * sizeof *a->v);
  a->hv = malloc(n * sizeof *a->hv);
  if (!a->v || !a->hv) {
    rc = pt__fail(err, PT_ENOMEM, "ABS: out of memory for two vectors of %zu floats", n);
    goto fail;
  }
  rc = pt__accel(err, ac_malloc(a->be, n * sizeof(float), (void **)&a->d_v), "ABS: ac_malloc");
  if (rc == PT_OK)
    rc = pt__accel(err, ac_malloc(a->be, n * sizeof(float), (void **)&a->d_hv), "ABS: ac_malloc");
  if (rc != PT_OK) goto fail;
  *out = a;
  return PT_OK;
fail:
  pt_abs_destroy(a);
  return rc;
}

static void abs_directive(const pt_abs *a, pt_abs_directive *d) {
  d->batch = a->rule.batch;
  d->lr_scale = a->rule.lr_scale;
  d->adv_fraction = a->rule.adv_fraction;
}

void pt_abs_initial(const pt_abs *a, pt_abs_directive *d) {
  memset(d, 0, sizeof *d);
  abs_directive(a, d);
  d->lambda = NAN;
  d->decision = PC_ABS_KEPT;
}

/* The top eigenvalue by power iteration, one product per round trip. */
static int abs_estimate(pt_abs *a, int (*grad)(void *ctx), void *ctx, pc_abs_power *p,
                        pt_error *err) {
  size_t bytes = a->hvp.numel * sizeof(float);
  int rc = pc_abs_power_start(p, a->hvp.numel, a->v, a->opts.seed + a->estimates++);
  if (rc != PC_OK) return pt__fail(err, PT_EINVAL, "ABS: %s", pc_strerror(rc));
  while (!p->done) {
    rc = pt__accel(err, ac_memcpy_h2d(a->be, a->d_v, p->v, bytes), "ABS: probe upload");
    if (rc == PT_OK)
      rc = pt__accel(err,
                     ac_hvp_compute(&a->hvp, a->d_v, a->opts.hv_rel_step, grad, ctx, a->d_hv, NULL),
                     "ABS: Hessian-vector product");
    if (rc == PT_OK)
      rc = pt__accel(err, ac_memcpy_d2h(a->be, a->hv, a->d_hv, bytes), "ABS: product download");
    if (rc != PT_OK) return rc;
    int prc = pc_abs_power_step(p, &a->opts, a->hv);
    if (prc != PC_OK)
      return pt__fail(err, PT_EACCEL, "ABS: power iteration step %d: %s", p->iters + 1,
                      pc_strerror(prc));
  }
  return PT_OK;
}

int pt_abs_epoch(pt_abs *a, int (*grad)(void *ctx), void *ctx, pt_abs_directive *d, pt_error *err) {
  if (!a || !grad || !d) return pt__fail(err, PT_EINVAL, "pt_abs_epoch: NULL argument");
  pt_abs_initial(a, d);
  if (!pc_abs_rule_active(&a->rule, &a->opts)) {
    d->decision = PC_ABS_AT_MAX;
    return PT_OK;
  }
  pc_abs_power p;
  int rc = abs_estimate(a, grad, ctx, &p, err);
  if (rc != PT_OK) return rc;
  pc_abs_decision decision;
  int rrc = pc_abs_rule_epoch(&a->rule, &a->opts, p.lambda, &decision);
  if (rrc != PC_OK) return pt__fail(err, PT_EINVAL, "ABS: the rule: %s", pc_strerror(rrc));
  abs_directive(a, d);
  d->lambda = p.lambda;
  d->power_iters = p.iters;
  d->converged = p.status == PC_OK;
  d->decision = decision;
  return PT_OK;
}
