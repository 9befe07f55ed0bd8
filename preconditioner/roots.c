/*
 * roots.c -- inverse p-th roots of symmetric PSD matrices: the coupled Newton iteration
 * (precond's scaled, symmetric variant and the textbook one) and the eigendecomposition
 * route. The kernels live in roots_impl.h, instantiated here for fp32 and fp64; this file
 * holds the argument checks, the scalar model of a Newton step and the dispatch.
 *
 * Error measure (pc_root_info.error): Newton reports max|M - I| of its accepted iterate,
 * where M = X^p (A + ridge I) is carried by the coupled iteration. eigh reports
 * max|X^p (A + ridge I) - I| over 8 evenly spaced columns, computed in fp64 (the full
 * residual would cost p more matrix products than the root itself).
 */
#include <float.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include <sys/mman.h>

#include <cblas.h>
#include <lapacke.h>

#include "pc_internal.h"

/* Panel height of the one-triangle product, and the size below which a plain gemm wins. */
#define PC_PANEL         ((size_t)128)
#define PC_PANEL_MIN_N   ((size_t)256)
#define PC_RESIDUAL_COLS ((size_t)8)

/* PC_METHOD_NEWTON: scaled steps, one-triangle products, and for fp32 input the steps in
 * fp64 until M's condition is below 1e5 (two steps from a relative ridge of 1e-6; docs/roots.md
 * has the measurements). */
const pc__newton_variant PC__NEWTON_DEFAULT = {
    .scaled = 1, .symmetric = 1, .floor = 1e-2, .lo_f32 = 1e-5};
static const pc__newton_variant NEWTON_TEXTBOOK = {.scaled = 0, .symmetric = 0, .floor = 0.0};

void pc_root_opts_default(pc_root_opts *opts, int p) {
  opts->p = p;
  opts->epsilon = 1e-6;
  opts->tol = 1e-6;
  opts->max_iters = 100;
  opts->method = PC_METHOD_NEWTON;
}

const char *pc_method_name(pc_method method) {
  switch (method) {
    case PC_METHOD_NEWTON:
      return "newton";
    case PC_METHOD_NEWTON_TEXTBOOK:
      return "newton-textbook";
    case PC_METHOD_EIGH:
      return "eigh";
    default:
      return "unknown";
  }
}

/* ------------------------------------------------------------------------------------ */
/* Argument checks                                                                        */

int pc__root_check(size_t n, const void *a, const void *x, const pc_root_opts *opts) {
  if (n == 0 || n > PC_ROOT_MAX_N || !a || !x || !opts || a == x) return PC_EINVAL;
  if (opts->p < 1 || opts->p > 1024) return PC_EINVAL;
  if (!(opts->epsilon >= 0.0) || !isfinite(opts->epsilon)) return PC_EINVAL;
  if (!(opts->tol >= 0.0) || !isfinite(opts->tol)) return PC_EINVAL;
  if (opts->max_iters < 1) return PC_EINVAL;
  if (opts->method != PC_METHOD_NEWTON && opts->method != PC_METHOD_NEWTON_TEXTBOOK &&
      opts->method != PC_METHOD_EIGH)
    return PC_EINVAL;
  return PC_OK;
}

static int variant_check(const pc__newton_variant *v) {
  if (!v || !(v->floor >= 0.0 && v->floor < 1.0) || !(v->lo_f32 >= 0.0)) return PC_EINVAL;
  return PC_OK;
}

/* ------------------------------------------------------------------------------------ */
/* Scratch memory                                                                         */

/* Large scratch blocks in 2 MiB pages where the kernel offers them (transparent huge pages
 * on request): the Newton workspace is 5 n^2 values, fresh on every call, and faulting it in
 * 4 KiB pages took about a third of an n = 1024 run in this VM. Freed with free(). */
#define PC_HUGE ((size_t)2 << 20)
double pc__ridge(double epsilon, double lambda_max) {
  return epsilon * (lambda_max > 1e-16 ? lambda_max : 1e-16);
}

void *pc__scratch_alloc(size_t bytes) {
#ifdef MADV_HUGEPAGE
  if (bytes >= 2 * PC_HUGE) {
    size_t rounded = (bytes + PC_HUGE - 1) / PC_HUGE * PC_HUGE;
    void *p = NULL;
    if (posix_memalign(&p, PC_HUGE, rounded) != 0) return NULL;
    (void)madvise(p, rounded, MADV_HUGEPAGE); /* a hint: failure only costs speed */
    return p;
  }
#endif
  return malloc(bytes);
}

/* ------------------------------------------------------------------------------------ */
/* Scalar model of one scaled Newton step                                                 */

/* Deviation of a symmetric M from I: extreme diagonal values, largest off-diagonal
 * magnitude, |M - I|_F, and max|M - I|. */
typedef struct {
  double dmin, dmax, offmax, frob, maxdev;
} root_dev;

/* max|s M - I| from the stored extremes, without another pass over M. */
static double dev_scaled(const root_dev *d, double s) {
  double a = fabs(s * d->dmin - 1.0), b = fabs(s * d->dmax - 1.0), c = s * d->offmax;
  double r = a > b ? a : b;
  return c > r ? c : r;
}

/* One Newton step maps an eigenvalue m of M to phi(m) = m ((p+1-m)/p)^p: increasing on
 * (0, 1), decreasing on (1, p+1), with phi(1) = 1 its maximum. */
static double phi(double m, int p) {
  return m * pow((p + 1.0 - m) / p, p);
}

/* |M - I|_2 <= |M - I|_F = f, so M's spectrum lies in [1 - f, 1 + f] as well. */
static void interval_tighten(double *lo, double *hi, double f) {
  double nlo = *lo > 1.0 - f ? *lo : 1.0 - f;
  double nhi = *hi < 1.0 + f ? *hi : 1.0 + f;
  if (nlo <= nhi) {
    *lo = nlo;
    *hi = nhi;
  } else { /* the carried model drifted (rounding): trust the norm bound */
    *lo = 1.0 - f > 0.0 ? 1.0 - f : 0.0;
    *hi = 1.0 + f;
  }
}

/* The scale s for which phi(s lo) == phi(s hi): after the step both ends of the interval
 * sit at the same height, the best a single step can lift the low end. s is capped so that
 * T = ((p+1) I - s M)/p keeps T^p >= top_floor and T >= 0.1 at the top of the spectrum: a
 * step that nearly annihilates the top of M costs fp32 accuracy (measured in docs/roots.md;
 * the second bound is the one that binds for p = 1). */
static double equalizing_scale(double lo, double hi, int p, double top_floor) {
  if (hi - lo <= 1e-12 * hi) return 2.0 / (lo + hi); /* a point: map it to 1 */
  double t_top = pow(top_floor, 1.0 / p);
  if (top_floor > 0.0 && t_top < 0.1) t_top = 0.1;
  double a = 1.0 / hi, b = (p + 1.0 - p * t_top) / hi;
  if (phi(b * lo, p) <= phi(b * hi, p)) return b;
  for (int i = 0; i < 80; i++) { /* phi(s lo) - phi(s hi) grows with s on [a, b] */
    double c = sqrt(a * b);
    if (phi(c * lo, p) < phi(c * hi, p))
      a = c;
    else
      b = c;
  }
  return sqrt(a * b);
}

/* The interval after a step with scale s. */
static void interval_advance(double *lo, double *hi, double s, int p) {
  double a = phi(s * *lo, p), b = phi(s * *hi, p);
  int straddles = s * *lo <= 1.0 && 1.0 <= s * *hi;
  *lo = a < b ? a : b;
  *hi = straddles ? 1.0 : (a > b ? a : b);
}

/* Where a Newton run stands; shared by both precisions so a run can switch between them. */
typedef struct {
  double lo, hi; /* interval holding M's spectrum (scaled variant) */
  double xscale; /* > 0: X is xscale * I and not stored */
  double err;    /* max|M - I| of the accepted iterate */
  int iters;     /* steps computed, a rejected one included */
  int stopped;   /* the divergence guard or the rounding floor ended the run */
  root_dev dev;  /* deviation of the accepted M from I */
} newton_state;

/* ------------------------------------------------------------------------------------ */
/* Kernels, one instance per precision                                                    */

#define REAL      float
#define REAL_MIN  FLT_MIN
#define SFX(name) name##_f32
#define GEMM      cblas_sgemm
#define SYRK      cblas_ssyrk
#define SYEVD     LAPACKE_ssyevd
#include "roots_impl.h"
#undef REAL
#undef REAL_MIN
#undef SFX
#undef GEMM
#undef SYRK
#undef SYEVD

#define REAL      double
#define REAL_MIN  DBL_MIN
#define SFX(name) name##_f64
#define GEMM      cblas_dgemm
#define SYRK      cblas_dsyrk
#define SYEVD     LAPACKE_dsyevd
#include "roots_impl.h"
#undef REAL
#undef REAL_MIN
#undef SFX
#undef GEMM
#undef SYRK
#undef SYEVD

/* The kernels the steady-state roots (warm.c) share with these, without their checks. */
void pc__mirror_upper_f32(size_t n, float *a) {
  mirror_upper_f32(n, a);
}
void pc__mirror_upper_f64(size_t n, double *a) {
  mirror_upper_f64(n, a);
}
int pc__eig_decompose_f32(size_t n, const float *a, float *vt, float *w) {
  return eig_decompose_f32(n, a, vt, w);
}
int pc__eig_decompose_f64(size_t n, const double *a, double *vt, double *w) {
  return eig_decompose_f64(n, a, vt, w);
}
void pc__eig_assemble_f32(size_t n, float *vt, const float *w, int p, double ridge, float *x) {
  eig_assemble_f32(n, vt, w, p, ridge, x);
}
void pc__eig_assemble_f64(size_t n, double *vt, const double *w, int p, double ridge, double *x) {
  eig_assemble_f64(n, vt, w, p, ridge, x);
}
int pc__sampled_residual_f32(size_t n, const float *a, double ridge, const float *x, int p,
                             double *res) {
  return sampled_residual_f32(n, a, ridge, x, p, res);
}
int pc__sampled_residual_f64(size_t n, const double *a, double ridge, const double *x, int p,
                             double *res) {
  return sampled_residual_f64(n, a, ridge, x, p, res);
}

/* ------------------------------------------------------------------------------------ */
/* Mixed precision: the first steps in fp64                                                */

/* In the first steps M's smallest eigenvalues sit near ridge/lambda_max, and an fp32 product
 * perturbs them by about 6e-8 |M|: up to tens of percent of their value, which the root
 * inherits. Running the steps in fp64 until M's condition is below 1 / v->lo_f32, then the
 * rest in fp32, keeps that error out at the price of a few fp64 steps (docs/roots.md). */
static int newton_mixed_route_f32(size_t n, const float *a, float *x, const pc_root_opts *opts,
                                  const pc__newton_variant *v, pc_root_info *info) {
  double lo = 0, hi = 0;
  info->iters = 0;
  info->error = INFINITY;
  int st = newton_bounds_f32(n, a, opts->epsilon, info, &lo, &hi);
  if (st != PC_OK) return st;
  const size_t nn = n * n;
  double *buf = pc__scratch_alloc(5 * nn * sizeof *buf);
  if (!buf) return PC_ENOMEM;
  newton_ws_f64 w64;
  newton_ws_carve_f64(&w64, buf, n);
  for (size_t i = 0; i < nn; i++) w64.m[i] = a[i];
  for (size_t i = 0; i < n; i++) w64.m[i * n + i] += info->ridge;
  newton_state ns;
  newton_start_f64(n, opts->p, lo, hi, v, &w64, &ns);
  newton_steps_f64(n, opts->p, opts->tol, opts->max_iters, v->lo_f32, v, &w64, &ns);
  /* The fp32 workspace takes the three fp64 buffers that M and X do not occupy (each holds
   * two fp32 matrices), so no new memory is touched. */
  newton_ws_f32 w32;
  w32.m = (float *)w64.t;
  w32.x = (float *)w64.t + nn;
  w32.t = (float *)w64.pw;
  w32.pw = (float *)w64.pw + nn;
  w32.tmp = (float *)w64.tmp;
  for (size_t i = 0; i < nn; i++) w32.m[i] = (float)w64.m[i];
  if (ns.xscale == 0.0)
    for (size_t i = 0; i < nn; i++) w32.x[i] = (float)w64.x[i];
  newton_steps_f32(n, opts->p, opts->tol, opts->max_iters, 0.0, v, &w32, &ns);
  newton_result_f32(n, &w32, &ns, x);
  free(buf);
  info->iters = ns.iters;
  info->error = ns.err;
  return ns.err <= opts->tol ? PC_OK : PC_NOT_CONVERGED;
}

/* ------------------------------------------------------------------------------------ */
/* Public entry points                                                                    */

/* fp32 runs change precision half-way when the variant asks for it. */
#define NEWTON_ROUTE_f32(n, a, x, opts, v, info)                      \
  ((v)->lo_f32 > 0.0 ? newton_mixed_route_f32(n, a, x, opts, v, info) \
                     : newton_route_f32(n, a, x, opts, v, info))
#define NEWTON_ROUTE_f64 newton_route_f64

#define PC_ROOT_ENTRY(REAL, SFXN)                                                           \
  int pc__newton_root_##SFXN(size_t n, const REAL *a, REAL *x, const pc_root_opts *opts,    \
                             const pc__newton_variant *variant, pc_root_info *info) {       \
    pc_root_info scratch;                                                                   \
    if (pc__root_check(n, a, x, opts) != PC_OK || variant_check(variant) != PC_OK)          \
      return PC_EINVAL;                                                                     \
    if (!pc_all_finite_##SFXN(n * n, a)) return PC_ENONFINITE_INPUT;                        \
    if (!info) info = &scratch;                                                             \
    unsigned fp = pc__ftz_enter();                                                          \
    int st = NEWTON_ROUTE_##SFXN(n, a, x, opts, variant, info);                             \
    pc__ftz_leave(fp);                                                                      \
    if (st >= 0 && !pc_all_finite_##SFXN(n * n, x)) st = PC_ENONFINITE_RESULT;              \
    return st;                                                                              \
  }                                                                                         \
                                                                                            \
  int pc_inverse_root_##SFXN(size_t n, const REAL *a, REAL *x, const pc_root_opts *opts,    \
                             pc_root_info *info) {                                          \
    pc_root_info scratch;                                                                   \
    if (pc__root_check(n, a, x, opts) != PC_OK) return PC_EINVAL;                           \
    if (opts->method != PC_METHOD_EIGH)                                                     \
      return pc__newton_root_##SFXN(                                                        \
          n, a, x, opts,                                                                    \
          opts->method == PC_METHOD_NEWTON ? &PC__NEWTON_DEFAULT : &NEWTON_TEXTBOOK, info); \
    if (!pc_all_finite_##SFXN(n * n, a)) return PC_ENONFINITE_INPUT;                        \
    if (!info) info = &scratch;                                                             \
    unsigned fp = pc__ftz_enter();                                                          \
    int st = eigh_##SFXN(n, a, x, opts->p, opts->epsilon, info);                            \
    pc__ftz_leave(fp);                                                                      \
    if (st >= 0 && !pc_all_finite_##SFXN(n * n, x)) st = PC_ENONFINITE_RESULT;              \
    return st;                                                                              \
  }

PC_ROOT_ENTRY(float, f32)
PC_ROOT_ENTRY(double, f64)

/* ------------------------------------------------------------------------------------ */
/* Subnormal control                                                                      */

#if defined(__x86_64__) || defined(_M_X64)
#include <xmmintrin.h>
/* MXCSR bits: 15 flush-to-zero, 6 denormals-are-zero. */
unsigned pc__ftz_enter(void) {
  unsigned saved = _mm_getcsr();
  _mm_setcsr(saved | 0x8040u);
  return saved;
}
void pc__ftz_leave(unsigned saved) {
  _mm_setcsr(saved);
}
#else
unsigned pc__ftz_enter(void) {
  return 0;
}
void pc__ftz_leave(unsigned saved) {
  (void)saved;
}
#endif
