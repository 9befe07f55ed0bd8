/*
 * kfac.c -- K-FAC's numerics (Martens & Grosse 2015; Grosse & Martens 2016; Osawa et al.
 * 2018; KAISA): options and the factor schedule, running averages of the factors,
 * pi-damping, damped inverses (Cholesky, eigh, coupled Newton with p = 1), the eigen form,
 * the per-layer update and the KL clip. The kernels live in kfac_impl.h, instantiated here
 * for fp32 and fp64; this file holds the options, the argument checks and the scalar rules.
 */
#include <limits.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include <cblas.h>
#include <lapacke.h>

#include "pc_internal.h"

void pc_kfac_opts_default(pc_kfac_opts *opts) {
  if (!opts) return;
  opts->factor_decay = 0.95;
  opts->damping = 1e-3;
  opts->pi_damping = 1;
  /* While the clip is active (every step of the ResNet: nu 0.009-0.3) c sets the step size;
   * at the 328-step ResNet protocol c 3e-4 reached 0.9011, 1e-4 0.8960, 1e-3 0.8979, 3e-3 0.8909
   * (docs/kfac.md, "Session 5": "The KL clip"). */
  opts->kl_clip = 3e-4;
  /* The clip is active at every step of the ResNet at c 1e-3 (nu 0.016-0.12): with the
   * step's own rate the cosine never reached the step (docs/kfac.md, "Tuning"). */
  opts->kl_base_lr = 1;
  opts->inv_every = 10;
  opts->factor_every_first = 1;
  opts->factor_every = 10;
  opts->first_epochs = 1;
  /* Measured with bench-roots --kfac (docs/kfac.md): Cholesky is the cheapest at every
   * size measured and as accurate as eigh, so eigh is only for the eigen form. */
  opts->eigh_min_n = SIZE_MAX;
}

static int positive_finite(double x) {
  return x > 0.0 && isfinite(x);
}

int pc_kfac_opts_check(const pc_kfac_opts *opts) {
  if (!opts) return PC_EINVAL;
  if (!(opts->factor_decay >= 0.0 && opts->factor_decay < 1.0)) return PC_EINVAL;
  if (!positive_finite(opts->damping) || !positive_finite(opts->kl_clip)) return PC_EINVAL;
  if (opts->pi_damping != 0 && opts->pi_damping != 1) return PC_EINVAL;
  if (opts->kl_base_lr != 0 && opts->kl_base_lr != 1) return PC_EINVAL;
  if (opts->inv_every < 1 || opts->factor_every_first < 1 || opts->factor_every < 1)
    return PC_EINVAL;
  if (opts->first_epochs < 0 || opts->eigh_min_n < 1) return PC_EINVAL;
  return PC_OK;
}

int pc_kfac_factor_due(const pc_kfac_opts *opts, long step, long steps_per_epoch) {
  if (!opts || step < 1 || steps_per_epoch < 1) return 0;
  /* The first phase ends after first_epochs whole epochs; saturate rather than overflow. */
  long first = opts->first_epochs > LONG_MAX / steps_per_epoch
                   ? LONG_MAX
                   : opts->first_epochs * steps_per_epoch;
  if (step <= first) return (step - 1) % opts->factor_every_first == 0;
  return (step - first - 1) % opts->factor_every == 0;
}

pc_kfac_inv pc_kfac_inv_for_size(const pc_kfac_opts *opts, size_t n) {
  return opts && n >= opts->eigh_min_n ? PC_KFAC_INV_EIGH : PC_KFAC_INV_CHOLESKY;
}

const char *pc_kfac_inv_name(pc_kfac_inv method) {
  switch (method) {
    case PC_KFAC_INV_CHOLESKY:
      return "cholesky";
    case PC_KFAC_INV_EIGH:
      return "eigh";
    case PC_KFAC_INV_NEWTON:
      return "newton";
    default:
      return "unknown";
  }
}

/* ------------------------------------------------------------------------------------ */
/* pi-damping and the KL clip: scalar rules                                               */

int pc_kfac_damping_split(size_t dim_a, double tr_a, size_t dim_g, double tr_g, double lambda,
                          int use_pi, pc_kfac_damping *out) {
  if (!out || dim_a == 0 || dim_g == 0 || !positive_finite(lambda)) return PC_EINVAL;
  if (!isfinite(tr_a) || !isfinite(tr_g)) return PC_ENONFINITE_INPUT;
  double pi = 1.0;
  int fallback = 0;
  if (use_pi) {
    /* A zero trace (a layer whose inputs or output gradients are all zero, e.g. dead ReLUs
     * or a factor not yet filled) would make pi 0 or infinite and one side's damping
     * infinite: keep the plain split instead. The ratio is formed as a product of square
     * roots so that neither quotient over- or underflows on its own. */
    if (tr_a > 0.0 && tr_g > 0.0) {
      pi = sqrt(tr_a / (double)dim_a) / sqrt(tr_g / (double)dim_g);
      if (!(pi > 0.0) || !isfinite(pi)) pi = 1.0, fallback = 1;
    } else {
      fallback = 1;
    }
  }
  double s = sqrt(lambda);
  out->pi = pi;
  out->damp_a = pi * s;
  out->damp_g = s / pi;
  out->pi_fallback = fallback;
  return PC_OK;
}

int pc_kfac_kl_scale(double kl_clip, double lr, double vg_sum, double *nu) {
  if (!nu || !positive_finite(kl_clip) || !(lr >= 0.0) || !isfinite(lr)) return PC_EINVAL;
  if (!isfinite(vg_sum)) {
    *nu = 0.0;
    return PC_ENONFINITE_INPUT;
  }
  double vg = fabs(lr * lr * vg_sum);
  double s = vg > 0.0 ? sqrt(kl_clip / vg) : 1.0;
  *nu = s < 1.0 ? s : 1.0;
  return PC_OK;
}

double pc_kfac_dot_f32(size_t count, const float *a, const float *b) {
  double s = 0.0;
  if (!a || !b) return 0.0;
  for (size_t i = 0; i < count; i++) s += (double)a[i] * b[i];
  return s;
}

/* ------------------------------------------------------------------------------------ */
/* Argument checks                                                                        */

/* The largest n whose n x n matrix BLAS and LAPACK can index with a 32-bit int. */
#define KFAC_MAX_N         ((size_t)46340)
#define KFAC_RESIDUAL_COLS ((size_t)8)

static int inverse_check(size_t n, const void *f, double damping, pc_kfac_inv method,
                         const void *x) {
  if (n == 0 || n > KFAC_MAX_N || !f || !x) return PC_EINVAL;
  if (!(damping >= 0.0) || !isfinite(damping)) return PC_EINVAL;
  if (method != PC_KFAC_INV_CHOLESKY && method != PC_KFAC_INV_EIGH && method != PC_KFAC_INV_NEWTON)
    return PC_EINVAL;
  return PC_OK;
}

static int eigen_check(size_t n, const void *f, const void *q, const void *v) {
  if (n == 0 || n > KFAC_MAX_N || !f || !q || !v) return PC_EINVAL;
  return PC_OK;
}

static int eigen_update_check(size_t out, size_t in, const void *qg, const void *vg,
                              const void *grad, size_t ld, const void *qa, const void *va,
                              double lambda, const void *p) {
  if (out == 0 || in == 0 || out > KFAC_MAX_N || in > KFAC_MAX_N || ld < in || ld > INT32_MAX)
    return PC_EINVAL;
  if (!qg || !vg || !grad || !qa || !va || !p) return PC_EINVAL;
  if (!(lambda >= 0.0) || !isfinite(lambda)) return PC_EINVAL;
  return PC_OK;
}

/* ------------------------------------------------------------------------------------ */
/* Kernels, one instance per precision                                                    */

#define REAL       float
#define SFX(name)  name##_f32
#define GEMM       cblas_sgemm
#define SYRK       cblas_ssyrk
#define SYEVD      LAPACKE_ssyevd
#define POTRF      LAPACKE_spotrf
#define POTRI      LAPACKE_spotri
#define NEWTON_TOL 1e-6
#include "kfac_impl.h"

#define REAL       double
#define SFX(name)  name##_f64
#define GEMM       cblas_dgemm
#define SYRK       cblas_dsyrk
#define SYEVD      LAPACKE_dsyevd
#define POTRF      LAPACKE_dpotrf
#define POTRI      LAPACKE_dpotri
#define NEWTON_TOL 1e-12
#include "kfac_impl.h"
