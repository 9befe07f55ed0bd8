/*
 * warm.c -- inverse p-th roots in the steady state: a statistic that moved a little since
 * its last root, warm-started from the eigenbasis held for it. The anchor is Distributed
 * Shampoo's warm-started eigendecomposition (B = V A V^T in the previous basis, skip when B
 * is nearly diagonal); the update here is one Jacobi step on every pair at once and a
 * Cholesky QR instead of a QR iteration on B, because it is gemm-rich (docs/roots.md,
 * "Steady state"). Kernels in warm_impl.h, instantiated here for fp32 and fp64; this file
 * holds the options, the checks, the basis's lifetime and the entry points.
 */
#include <float.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include <cblas.h>
#include <lapacke.h>

#include "pc_internal.h"

/* Panel height of B's one-triangle product. */
#define PC_WARM_PANEL ((size_t)128)

/* Largest |tan(theta)| of a pair whose eigenvalue correction a sweep applies (warm_jacobi).
 * Measured at n = 512 (docs/roots.md): without the limit the Shampoo statistic's warm root
 * was 40x less accurate. */
#define PC_WARM_TMAX 0.1

void pc_warm_opts_default(pc_warm_opts *opts) {
  if (!opts) return;
  opts->skip_tol = 1e-3;
  opts->reuse_root = 0;
  opts->sweeps = 1;
  opts->wide = 1;
  opts->max_change = 0.05;
  opts->guard_tol = 0.25;
  opts->eigh_below = 1e-4;
}

const char *pc_warm_path_name(pc_warm_path path) {
  switch (path) {
    case PC_WARM_SEEDED:
      return "seeded";
    case PC_WARM_ROTATED:
      return "rotated";
    case PC_WARM_SKIPPED:
      return "skipped";
    case PC_WARM_REUSED:
      return "reused";
    case PC_WARM_COLD:
      return "cold";
    case PC_WARM_EIGH:
      return "eigh";
    default:
      return "unknown";
  }
}

/* ------------------------------------------------------------------------------------ */
/* Argument checks                                                                        */

static int warm_opts_check(const pc_warm_opts *w) {
  if (!(w->skip_tol >= 0.0) || !isfinite(w->skip_tol)) return PC_EINVAL;
  if (w->reuse_root != 0 && w->reuse_root != 1) return PC_EINVAL;
  if (w->wide != 0 && w->wide != 1) return PC_EINVAL;
  if (w->sweeps < 1 || w->sweeps > 16) return PC_EINVAL;
  if (!(w->max_change > 0.0) || !(w->guard_tol > 0.0)) return PC_EINVAL; /* +Inf: no guard */
  if (!(w->eigh_below >= 0.0) || !isfinite(w->eigh_below)) return PC_EINVAL;
  return PC_OK;
}

static int warm_check(size_t n, const void *a, const void *x, const pc_root_opts *opts,
                      const pc_warm_opts *wopts, size_t basis_n, const void *vt, const double *w) {
  if (pc__root_check(n, a, x, opts) != PC_OK) return PC_EINVAL;
  if (basis_n != n || !vt || !w) return PC_EINVAL;
  return warm_opts_check(wopts);
}

/* ------------------------------------------------------------------------------------ */
/* Kernels                                                                                */

/* How far B (upper triangle) is from diagonal, two ways:
 * - *offdiag = |B - diag B|_F / |B|_F, the skip test's measure (Distributed Shampoo's);
 * - *change = |L[B - diag B]|_F / |f(diag B)|_F, the first-order change of the root that the
 *   off-diagonal part makes: L is the Frechet derivative of f(d) = (max(d, 0) + ridge)^(-1/p)
 *   at diag B (Daleckii and Krein: entry ij scaled by the divided difference
 *   (f(d_i) - f(d_j)) / (d_i - d_j), f'(d_i) when equal). It is about how far the held root
 *   is from the new one, and weighs each entry by the root's sensitivity, so that it sees the
 *   ridge-level directions that the Frobenius ratio, dominated by the top of the spectrum,
 *   does not. f: n doubles of scratch. */
static void offdiag_measure(size_t n, const double *b, int p, double epsilon, double *f,
                            double *offdiag, double *change) {
  double off = 0.0, diag = 0.0, lmax = b[0];
  for (size_t i = 0; i < n; i++) lmax = b[i * n + i] > lmax ? b[i * n + i] : lmax;
  const double ridge = pc__ridge(epsilon, lmax);
  double fsq = 0.0, dsq = 0.0;
  for (size_t i = 0; i < n; i++) {
    double d = b[i * n + i] > 0.0 ? b[i * n + i] : 0.0;
    f[i] = pow(d + ridge, -1.0 / p);
    fsq += f[i] * f[i];
  }
  for (size_t i = 0; i < n; i++) {
    double di = b[i * n + i];
    diag += di * di;
    for (size_t j = i + 1; j < n; j++) {
      double bij = b[i * n + j], dj = b[j * n + j];
      off += bij * bij;
      double dd;
      if (di != dj && (di > 0.0 || dj > 0.0))
        dd = (f[i] - f[j]) / (di - dj);
      else if (di > 0.0)
        dd = -f[i] / (p * (di + ridge));
      else
        dd = 0.0; /* both floored at the ridge: f is flat there */
      dsq += bij * bij * dd * dd;
    }
  }
  off *= 2.0;
  *offdiag = off + diag > 0.0 ? sqrt(off / (off + diag)) : 0.0;
  *change = fsq > 0.0 ? sqrt(2.0 * dsq / fsq) : 0.0;
}

/* Whether the eigh route pays for a statistic whose held eigenvalues (before the ridge) are
 * w: unit * kappa < below, kappa the condition the root sees, its ridge taken from the held
 * largest eigenvalue as the root takes it from the new one (pc__ridge). unit: the working
 * precision's epsilon, 0 where the route is off. */
static int eigh_pays(size_t n, const double *w, double epsilon, double unit, double below) {
  if (!(unit > 0.0) || !(below > 0.0)) return 0;
  double lmin = w[0], lmax = w[0];
  for (size_t i = 1; i < n; i++) {
    lmin = w[i] < lmin ? w[i] : lmin;
    lmax = w[i] > lmax ? w[i] : lmax;
  }
  const double ridge = pc__ridge(epsilon, lmax);
  const double kappa = ((lmax > 0.0 ? lmax : 0.0) + ridge) / ((lmin > 0.0 ? lmin : 0.0) + ridge);
  return unit * kappa < below; /* NaN: no */
}

#define REAL      float
#define SFX(name) name##_f32
#define GEMM      cblas_sgemm
#define SYRK      cblas_ssyrk
#define TRSM      cblas_strsm
#define POTRF     LAPACKE_spotrf
#define WIDE      1
#define EIGH_UNIT FLT_EPSILON
#include "warm_impl.h"

#define REAL      double
#define SFX(name) name##_f64
#define GEMM      cblas_dgemm
#define SYRK      cblas_dsyrk
#define TRSM      cblas_dtrsm
#define POTRF     LAPACKE_dpotrf
#define WIDE      0
#define EIGH_UNIT 0.0 /* fp64 eigh errs ~1e-16 kappa: not measured against the warm cost */
#include "warm_impl.h"

/* ------------------------------------------------------------------------------------ */
/* The basis and the entry points                                                         */

#define PC_WARM_ENTRY(REAL, SFXN)                                                             \
  size_t pc_eigbasis_bytes_##SFXN(size_t n) {                                                 \
    return n * n * sizeof(REAL) + n * sizeof(double);                                         \
  }                                                                                           \
                                                                                              \
  int pc_eigbasis_init_##SFXN(pc_eigbasis_##SFXN *basis, size_t n) {                          \
    if (!basis) return PC_EINVAL;                                                             \
    memset(basis, 0, sizeof *basis);                                                          \
    if (n == 0 || n > PC_ROOT_MAX_N) return PC_EINVAL;                                        \
    basis->vt = malloc(n * n * sizeof *basis->vt);                                            \
    basis->w = malloc(n * sizeof *basis->w);                                                  \
    if (!basis->vt || !basis->w) {                                                            \
      pc_eigbasis_destroy_##SFXN(basis);                                                      \
      return PC_ENOMEM;                                                                       \
    }                                                                                         \
    basis->n = n;                                                                             \
    return PC_OK;                                                                             \
  }                                                                                           \
                                                                                              \
  void pc_eigbasis_destroy_##SFXN(pc_eigbasis_##SFXN *basis) {                                \
    if (!basis) return;                                                                       \
    free(basis->vt);                                                                          \
    free(basis->w);                                                                           \
    memset(basis, 0, sizeof *basis);                                                          \
  }                                                                                           \
                                                                                              \
  int pc_inverse_root_warm_##SFXN(size_t n, const REAL *a, REAL *x, const pc_root_opts *opts, \
                                  const pc_warm_opts *wopts, pc_eigbasis_##SFXN *basis,       \
                                  pc_warm_info *info) {                                       \
    pc_warm_opts defaults;                                                                    \
    pc_warm_info scratch;                                                                     \
    if (!wopts) {                                                                             \
      pc_warm_opts_default(&defaults);                                                        \
      wopts = &defaults;                                                                      \
    }                                                                                         \
    if (!basis || warm_check(n, a, x, opts, wopts, basis->n, basis->vt, basis->w))            \
      return PC_EINVAL;                                                                       \
    if (!pc_all_finite_##SFXN(n * n, a)) return PC_ENONFINITE_INPUT;                          \
    if (!info) info = &scratch;                                                               \
    memset(info, 0, sizeof *info);                                                            \
    unsigned fp = pc__ftz_enter();                                                            \
    int st = warm_route_##SFXN(n, a, x, opts, wopts, basis, info);                            \
    pc__ftz_leave(fp);                                                                        \
    if (st >= 0 && !pc_all_finite_##SFXN(n * n, x)) {                                         \
      st = PC_ENONFINITE_RESULT;                                                              \
      basis->valid = 0;                                                                       \
    }                                                                                         \
    return st;                                                                                \
  }

PC_WARM_ENTRY(float, f32)
PC_WARM_ENTRY(double, f64)
