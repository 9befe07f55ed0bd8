/*
 * abs.c -- ABS / ABSA's numerics (Yao, Gholami, Lei, Keutzer, Mahoney 2018; algorithms note,
 * section 4): the options, a power iteration on the top Hessian eigenvalue driven one
 * Hessian-vector product at a time, and the adaptive-batch rule evaluated once per epoch.
 *
 * The power iteration is split at the product (pc_abs_power_step) because the product needs
 * the model and the data, which live on a worker, while the state (the probe, the estimate)
 * lives in the daemon: the daemon folds in each Hv and answers with the next probe.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>

#include "pc_internal.h"

void pc_abs_opts_default(pc_abs_opts *opts) {
  if (!opts) return;
  opts->power_max_iters = 10;
  opts->power_tol = 1e-2;
  opts->seed = 1;
  opts->base_batch = 128;
  opts->max_batch_factor = 128;
  opts->growth_epochs = 10;
  opts->ref_ratio = 0.5;
  opts->adv_fraction = 0.2;
  opts->adv_eps = 0.005;
  /* fp32 gradients: the central difference's truncation error grows as h^2 and its rounding
   * error as eps_f32 / h, which balance near h ~ eps_f32^(1/3) ~ 5e-3 of the weights' scale;
   * at 1e-3 the products of tests/accel/test_abs.c are within 1e-4 (relative) of the exact
   * and of the finite-difference Hessian's. */
  opts->hv_rel_step = 1e-3;
  opts->hv_batch = 128;
}

static int abs_finite_nonneg(double x) {
  return isfinite(x) && x >= 0.0;
}

int pc_abs_opts_check(const pc_abs_opts *opts) {
  if (!opts) return PC_EINVAL;
  if (opts->power_max_iters < 1 || !abs_finite_nonneg(opts->power_tol)) return PC_EINVAL;
  if (opts->base_batch < 1 || opts->max_batch_factor < 1 || opts->growth_epochs < 1)
    return PC_EINVAL;
  if ((uint64_t)opts->base_batch * opts->max_batch_factor > UINT32_MAX) return PC_EINVAL;
  if (!(opts->ref_ratio > 0.0 && opts->ref_ratio <= 1.0)) return PC_EINVAL;
  if (!(opts->adv_fraction >= 0.0 && opts->adv_fraction <= 1.0)) return PC_EINVAL;
  if (!abs_finite_nonneg(opts->adv_eps)) return PC_EINVAL;
  if (!(isfinite(opts->hv_rel_step) && opts->hv_rel_step > 0.0)) return PC_EINVAL;
  if (opts->hv_batch < 1) return PC_EINVAL;
  return PC_OK;
}

int pc_abs_power_start(pc_abs_power *p, size_t n, float *v, uint64_t seed) {
  if (!p || !v || n == 0) return PC_EINVAL;
  uint64_t state = seed;
  double norm2 = 0.0;
  /* Uniform in [-1, 1): a zero vector has probability 0, but keep redrawing if it comes. */
  while (norm2 == 0.0) {
    for (size_t i = 0; i < n; i++) {
      v[i] = (float)pc__uniform_pm1(&state);
      norm2 += (double)v[i] * v[i];
    }
  }
  double inv = 1.0 / sqrt(norm2);
  for (size_t i = 0; i < n; i++) v[i] = (float)(v[i] * inv);
  *p = (pc_abs_power){
      .n = n, .v = v, .lambda = NAN, .iters = 0, .done = 0, .status = PC_NOT_CONVERGED};
  return PC_OK;
}

static int abs_power_step_check(const pc_abs_power *p, const pc_abs_opts *opts, const float *hv) {
  if (!p || !opts || !hv || !p->v || p->n == 0 || p->done) return PC_EINVAL;
  if (opts->power_max_iters < 1 || !abs_finite_nonneg(opts->power_tol)) return PC_EINVAL;
  if (!pc_all_finite_f32(p->n, hv)) return PC_ENONFINITE_INPUT;
  return PC_OK;
}

int pc_abs_power_step(pc_abs_power *p, const pc_abs_opts *opts, const float *hv) {
  int rc = abs_power_step_check(p, opts, hv);
  if (rc != PC_OK) return rc;
  double dot = 0.0, norm2 = 0.0;
  for (size_t i = 0; i < p->n; i++) {
    dot += (double)hv[i] * p->v[i];
    norm2 += (double)hv[i] * hv[i];
  }
  double prev = p->lambda;
  p->lambda = dot;
  p->iters++;
  if (norm2 == 0.0 || (p->iters > 1 && fabs(dot - prev) <= opts->power_tol * fabs(prev))) {
    p->done = 1;
    p->status = PC_OK;
    return PC_OK;
  }
  if (p->iters >= opts->power_max_iters) {
    p->done = 1;
    p->status = PC_NOT_CONVERGED;
    return PC_OK;
  }
  double inv = 1.0 / sqrt(norm2);
  for (size_t i = 0; i < p->n; i++) p->v[i] = (float)(hv[i] * inv);
  return PC_OK;
}

const char *pc_abs_decision_name(pc_abs_decision d) {
  switch (d) {
    case PC_ABS_KEPT:
      return "kept";
    case PC_ABS_REFERENCE:
      return "reference";
    case PC_ABS_GREW_FLAT:
      return "grew-flat";
    case PC_ABS_GREW_FORCED:
      return "grew-forced";
    case PC_ABS_AT_MAX:
      return "at-max";
  }
  return "unknown";
}

static uint32_t abs_max_batch(const pc_abs_opts *opts) {
  return (uint32_t)((uint64_t)opts->base_batch * opts->max_batch_factor);
}

void pc_abs_rule_init(pc_abs_rule *r, const pc_abs_opts *opts) {
  *r = (pc_abs_rule){.batch = opts->base_batch,
                     .lr_scale = 1.0,
                     .adv_fraction = opts->adv_fraction,
                     .lambda_ref = NAN,
                     .epochs_since_growth = 0,
                     .growths = 0};
}

int pc_abs_rule_active(const pc_abs_rule *r, const pc_abs_opts *opts) {
  return r->batch < abs_max_batch(opts);
}

/* Batch x2 up to the cap, the learning rate by the same ratio (linear scaling), the
 * adversarial share halved. */
static void abs_grow(pc_abs_rule *r, const pc_abs_opts *opts) {
  uint64_t next = 2 * (uint64_t)r->batch, cap = abs_max_batch(opts);
  if (next > cap) next = cap;
  r->lr_scale *= (double)next / r->batch;
  r->batch = (uint32_t)next;
  r->adv_fraction *= 0.5;
  r->epochs_since_growth = 0;
  r->growths++;
}

int pc_abs_rule_epoch(pc_abs_rule *r, const pc_abs_opts *opts, double lambda,
                      pc_abs_decision *decision) {
  if (!r || !opts || !decision) return PC_EINVAL;
  if (!isfinite(lambda)) return PC_ENONFINITE_INPUT;
  /* The power iteration finds the eigenvalue of largest magnitude, which early in training
   * can be negative (measured on the ResNet at initialisation): the sharpness the rule
   * follows is that magnitude. */
  lambda = fabs(lambda);
  if (!pc_abs_rule_active(r, opts)) {
    *decision = PC_ABS_AT_MAX;
    return PC_OK;
  }
  if (isnan(r->lambda_ref)) {
    r->lambda_ref = lambda;
    r->epochs_since_growth++;
    *decision = PC_ABS_REFERENCE;
    return PC_OK;
  }
  if (lambda <= opts->ref_ratio * r->lambda_ref) {
    r->lambda_ref = lambda;
    abs_grow(r, opts);
    *decision = PC_ABS_GREW_FLAT;
    return PC_OK;
  }
  /* This epoch is the growth_epochs-th in a row without a growth. */
  if (r->epochs_since_growth + 1 >= opts->growth_epochs) {
    abs_grow(r, opts);
    *decision = PC_ABS_GREW_FORCED;
    return PC_OK;
  }
  r->epochs_since_growth++;
  *decision = PC_ABS_KEPT;
  return PC_OK;
}

double pc_abs_adv_fraction(const pc_abs_rule *r, double progress) {
  if (!r || !(progress < 0.5)) return 0.0;
  return r->adv_fraction;
}
