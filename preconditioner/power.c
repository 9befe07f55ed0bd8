/* power.c -- largest eigenvalue of a symmetric PSD matrix by power iteration.
 *
 * The start vector comes from a fixed-seed generator so that every run (and every replica)
 * gets the same estimate; the estimate is the Rayleigh quotient v^T A v of the unit iterate,
 * which for a symmetric matrix converges twice as fast as the vector itself. */
#include <math.h>
#include <stdlib.h>

#include <cblas.h>

#include "pc_internal.h"

void pc_power_opts_default(pc_power_opts *opts) {
  opts->max_iters = 100;
  opts->tol = 1e-6;
  opts->seed = 1;
}

static int power_opts_check(const pc_power_opts *opts) {
  if (opts->max_iters < 1 || !(opts->tol >= 0.0) || !isfinite(opts->tol)) return PC_EINVAL;
  return PC_OK;
}

/* splitmix64: a tiny, well-mixed generator; only the start vector depends on it. */
static uint64_t power_next(uint64_t *state) {
  uint64_t z = (*state += 0x9e3779b97f4a7c15ull);
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

double pc__uniform_pm1(uint64_t *state) {
  return (double)(power_next(state) >> 11) * 0x1.0p-52 - 1.0;
}

#define PC_POWER_KERNEL(REAL, GEMV, SUFFIX)                                                  \
  int pc__power_##SUFFIX(size_t n, const REAL *a, const pc_power_opts *opts, double *lambda, \
                         int *iters) {                                                       \
    pc_power_opts defaults;                                                                  \
    if (!opts) {                                                                             \
      pc_power_opts_default(&defaults);                                                      \
      opts = &defaults;                                                                      \
    }                                                                                        \
    REAL *v = malloc(2 * n * sizeof *v);                                                     \
    if (!v) return PC_ENOMEM;                                                                \
    REAL *w = v + n;                                                                         \
    uint64_t state = opts->seed;                                                             \
    double norm = 0.0;                                                                       \
    for (size_t i = 0; i < n; i++) {                                                         \
      double r = pc__uniform_pm1(&state);                                                    \
      v[i] = (REAL)r;                                                                        \
      norm += r * r;                                                                         \
    }                                                                                        \
    norm = sqrt(norm);                                                                       \
    for (size_t i = 0; i < n; i++) v[i] = (REAL)(v[i] / norm);                               \
    int status = PC_NOT_CONVERGED, it = 0;                                                   \
    double est = 0.0, prev = 0.0;                                                            \
    while (it < opts->max_iters) {                                                           \
      GEMV(CblasRowMajor, CblasNoTrans, (int)n, (int)n, 1, a, (int)n, v, 1, 0, w, 1);        \
      it++;                                                                                  \
      double dot = 0.0, ww = 0.0;                                                            \
      for (size_t i = 0; i < n; i++) {                                                       \
        dot += (double)v[i] * w[i];                                                          \
        ww += (double)w[i] * w[i];                                                           \
      }                                                                                      \
      est = dot;                                                                             \
      if (ww == 0.0) { /* v lies in the null space: A v = 0 */                               \
        status = PC_OK;                                                                      \
        break;                                                                               \
      }                                                                                      \
      if (it > 1 && fabs(est - prev) <= opts->tol * fabs(est)) {                             \
        status = PC_OK;                                                                      \
        break;                                                                               \
      }                                                                                      \
      prev = est;                                                                            \
      double inv = 1.0 / sqrt(ww);                                                           \
      for (size_t i = 0; i < n; i++) v[i] = (REAL)(w[i] * inv);                              \
    }                                                                                        \
    free(v);                                                                                 \
    *lambda = est;                                                                           \
    if (iters) *iters = it;                                                                  \
    return status;                                                                           \
  }

PC_POWER_KERNEL(float, cblas_sgemv, f32)
PC_POWER_KERNEL(double, cblas_dgemv, f64)

int pc_power_iteration_f32(size_t n, const float *a, const pc_power_opts *opts, double *lambda,
                           int *iters) {
  if (n == 0 || n > (size_t)INT32_MAX || !a || !lambda) return PC_EINVAL;
  if (opts && power_opts_check(opts) != PC_OK) return PC_EINVAL;
  if (!pc_all_finite_f32(n * n, a)) return PC_ENONFINITE_INPUT;
  return pc__power_f32(n, a, opts, lambda, iters);
}

int pc_power_iteration_f64(size_t n, const double *a, const pc_power_opts *opts, double *lambda,
                           int *iters) {
  if (n == 0 || n > (size_t)INT32_MAX || !a || !lambda) return PC_EINVAL;
  if (opts && power_opts_check(opts) != PC_OK) return PC_EINVAL;
  if (!pc_all_finite_f64(n * n, a)) return PC_ENONFINITE_INPUT;
  return pc__power_f64(n, a, opts, lambda, iters);
}
