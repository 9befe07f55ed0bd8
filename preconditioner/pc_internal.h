/*
 * pc_internal.h -- internal helpers shared by the .c files of preconditioner/.
 * Outside code must not include this header; names carry the prefix pc__.
 */
#ifndef PRECOND_PC_INTERNAL_H
#define PRECOND_PC_INTERNAL_H

#include <stddef.h>

#include "preconditioner.h"

/* Floating-point control for the threads that run an iteration: late Newton iterates can
 * underflow to subnormals, which slows BLAS kernels by orders of magnitude (algorithms note,
 * section 1). pc__ftz_enter sets flush-to-zero and denormals-are-zero in the calling thread
 * and returns the previous control word; pc__ftz_leave restores it. No-ops off x86-64. */
unsigned pc__ftz_enter(void);
void pc__ftz_leave(unsigned saved);

/* Power iteration without argument checks (the callers have checked a is finite). */
/* A uniform draw in [-1, 1) from splitmix64 on *state: the fixed-seed start vectors of the
 * power iterations (power.c, abs.c), so that every run and replica gets the same ones. */
double pc__uniform_pm1(uint64_t *state);
int pc__power_f32(size_t n, const float *a, const pc_power_opts *opts, double *lambda, int *iters);
int pc__power_f64(size_t n, const double *a, const pc_power_opts *opts, double *lambda, int *iters);

/* Variants of the coupled Newton iteration, selectable by the benchmark to measure what
 * each change buys. PC_METHOD_NEWTON uses PC__NEWTON_DEFAULT. */
typedef struct {
  int scaled;    /* 1: per-step scalar rescaling from spectral bounds; 0: Frobenius start */
  int symmetric; /* 1: syrk squarings and one-triangle products; 0: full gemm */
  double floor;  /* scaled steps keep T's smallest eigenvalue^p >= floor, i.e. they map
                     the top of M's spectrum no lower than about floor */
  double lo_f32; /* fp32 inputs: > 0 runs the steps in fp64 until M's spectrum lies in
                     [lo, hi] with lo / hi >= lo_f32, then in fp32; 0: fp32 throughout */
} pc__newton_variant;

extern const pc__newton_variant PC__NEWTON_DEFAULT;

/* Inverse p-th root by the coupled Newton iteration with an explicit variant; same contract
 * as pc_inverse_root_f32/f64 (opts->method is ignored). */
int pc__newton_root_f32(size_t n, const float *a, float *x, const pc_root_opts *opts,
                        const pc__newton_variant *variant, pc_root_info *info);
int pc__newton_root_f64(size_t n, const double *a, double *x, const pc_root_opts *opts,
                        const pc__newton_variant *variant, pc_root_info *info);

/* The ridge rule of every root: epsilon * max(lambda_max, 1e-16) (relative ridge). */
double pc__ridge(double epsilon, double lambda_max);

/* The largest n whose n x n matrix BLAS can index with a 32-bit int. */
#define PC_ROOT_MAX_N ((size_t)46340)

/* The argument checks of pc_inverse_root_*: PC_OK or PC_EINVAL. */
int pc__root_check(size_t n, const void *a, const void *x, const pc_root_opts *opts);

/* Scratch of at least bytes, in 2 MiB pages where the kernel offers them (large n x n
 * workspaces are fresh on every call; faulting them in 4 KiB pages cost a third of an
 * n = 1024 root). NULL when out of memory; the caller frees it with free(). */
void *pc__scratch_alloc(size_t bytes);

/* Copies the upper triangle of the n x n row-major a onto the lower one (off-diagonal
 * subnormals flushed on the way). */
void pc__mirror_upper_f32(size_t n, float *a);
void pc__mirror_upper_f64(size_t n, double *a);

/* a = V diag(w) V^T by syevd: vt gets the eigenvectors as rows, w the eigenvalues in
 * ascending order. PC_OK, PC_ENOMEM or PC_ELAPACK. */
int pc__eig_decompose_f32(size_t n, const float *a, float *vt, float *w);
int pc__eig_decompose_f64(size_t n, const double *a, double *vt, double *w);

/* x = V diag((max(w, 0) + ridge)^(-1/p)) V^T from eigenvector rows vt (scaled in place). */
void pc__eig_assemble_f32(size_t n, float *vt, const float *w, int p, double ridge, float *x);
void pc__eig_assemble_f64(size_t n, double *vt, const double *w, int p, double ridge, double *x);

/* max|X^p (A + ridge I) - I| over 8 evenly spaced columns (all when n < 8), in fp64: the
 * residual eigh reports, and the steady-state roots' accuracy guard. PC_OK or PC_ENOMEM. */
int pc__sampled_residual_f32(size_t n, const float *a, double ridge, const float *x, int p,
                             double *res);
int pc__sampled_residual_f64(size_t n, const double *a, double ridge, const double *x, int p,
                             double *res);

#endif /* PRECOND_PC_INTERNAL_H */
