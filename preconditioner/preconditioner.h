/*
 * preconditioner.h -- precond's numerics core: the one public header of preconditioner/.
 *
 * Pure numerics: no I/O, no threads of its own, no globals; every function is reentrant.
 * Public names carry the prefix pc_; internal ones live in .c files as static functions or
 * with the prefix pc__ (declared in pc_internal.h, which outside code must not include).
 *
 * Conventions
 * - Dense matrices are row-major. A symmetric n x n matrix is stored dense (n*n values,
 *   both triangles valid) or packed: the upper triangle row by row,
 *   a[0][0..n-1], a[1][1..n-1], ..., a[n-1][n-1]: n(n+1)/2 values (pc_packed_len).
 *   (Row-major upper packed is the same memory as LAPACK's column-major lower packed.)
 * - Functions return int: PC_OK (0), a positive warning (the result is written but is
 *   not as good as asked), or a negative error (nothing useful was written).
 *   pc_strerror turns any of them into a static message.
 * - The caller owns every buffer it passes; functions that need scratch memory
 *   allocate and free it themselves and return PC_ENOMEM if they cannot.
 * - Argument checks live in static *_check functions at the top of each .c file, apart
 *   from the numeric kernels, so that a kernel reads like the paper.
 */
#ifndef PRECOND_PRECONDITIONER_H
#define PRECOND_PRECONDITIONER_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* ------------------------------------------------------------------------------------ */
/* Status codes                                                                           */

enum {
  PC_OK = 0,
  PC_NOT_CONVERGED = 1,      /* root written, but its error is above the tolerance */
  PC_EINVAL = -1,            /* bad argument (size, null pointer, option out of range) */
  PC_ENONFINITE_INPUT = -2,  /* NaN or Inf in the input; nothing computed */
  PC_ENONFINITE_RESULT = -3, /* the computation produced NaN or Inf; output not usable */
  PC_ENOMEM = -4,            /* scratch allocation failed */
  PC_ELAPACK = -5            /* LAPACK reported a failure (e.g. syevd did not converge) */
};

/* Returns a static, human-readable message for a status code. Never returns NULL. */
const char *pc_strerror(int status);

/* ------------------------------------------------------------------------------------ */
/* Symmetric matrix helpers and transport formats                                         */

/* n(n+1)/2: values in a packed upper triangle of an n x n matrix. */
size_t pc_packed_len(size_t n);

/* Dense (row-major, n x n, only the upper triangle is read) to packed upper. */
void pc_pack_f32(size_t n, const float *dense, float *packed);
void pc_pack_f64(size_t n, const double *dense, double *packed);

/* Packed upper to dense (row-major n x n; both triangles written). */
void pc_unpack_f32(size_t n, const float *packed, float *dense);
void pc_unpack_f64(size_t n, const double *packed, double *dense);

/* pc_unpack_f32 into dense rows ld apart (ld >= n) that also checks the values: returns 1 if
 * all are finite, else 0 (dense then holds the values anyway). One pass over packed: a
 * consumer that checks and unpacks (a worker installing roots) reads them once. */
int pc_unpack_finite_f32(size_t n, const float *packed, float *dense, size_t ld);

/* bfloat16 transport: fp32 -> bf16 rounds to nearest even (NaN stays NaN);
 * bf16 -> fp32 is exact. count values each. */
void pc_f32_to_bf16(size_t count, const float *in, uint16_t *out);
void pc_bf16_to_f32(size_t count, const uint16_t *in, float *out);

/* Returns 1 if all count values are finite, else 0. */
int pc_all_finite_f32(size_t count, const float *x);
int pc_all_finite_f64(size_t count, const double *x);

/* ------------------------------------------------------------------------------------ */
/* Largest eigenvalue by power iteration                                                  */

typedef struct {
  int max_iters; /* default 100 */
  double tol;    /* relative change of the estimate that stops it; default 1e-6 */
  uint64_t seed; /* start vector seed: fixed, so results are reproducible; default 1 */
} pc_power_opts;

void pc_power_opts_default(pc_power_opts *opts);

/* Largest eigenvalue of the symmetric PSD n x n dense matrix a. Writes *lambda and, if
 * iters is not NULL, the number of iterations. Returns PC_OK, PC_NOT_CONVERGED (estimate
 * written) or an error. opts may be NULL for the defaults. */
int pc_power_iteration_f32(size_t n, const float *a, const pc_power_opts *opts, double *lambda,
                           int *iters);
int pc_power_iteration_f64(size_t n, const double *a, const pc_power_opts *opts, double *lambda,
                           int *iters);

/* ------------------------------------------------------------------------------------ */
/* Inverse p-th roots                                                                     */

typedef enum {
  PC_METHOD_NEWTON = 0,      /* precond's coupled Newton: scaled steps, one-triangle products,
                                 fp64 first steps for fp32 input (docs/roots.md); the default */
  PC_METHOD_NEWTON_TEXTBOOK, /* the reference iteration of Anil et al. 2020, for comparison */
  PC_METHOD_EIGH             /* LAPACK syevd, then V diag(w^(-1/p)) V^T */
} pc_method;

/* Short lowercase name of a method ("newton", "newton-textbook", "eigh"). */
const char *pc_method_name(pc_method method);

typedef struct {
  int p;            /* root order: the result approximates (A + ridge I)^(-1/p); p >= 1 */
  double epsilon;   /* relative ridge: ridge = epsilon * max(lambda_max, 1e-16); 1e-6 */
  double tol;       /* stop when max|M - I| <= tol; default 1e-6 (fp32), tighter in fp64 */
  int max_iters;    /* iteration cap; default 100 */
  pc_method method; /* default PC_METHOD_NEWTON */
} pc_root_opts;

/* Fills the published defaults for root order p (see the algorithms note, section 1). */
void pc_root_opts_default(pc_root_opts *opts, int p);

typedef struct {
  int iters;         /* Newton steps computed, a rejected one included (0 for eigh) */
  double error;      /* final max|M - I| for Newton; for eigh max|X^p (A + ridge I) - I|
                         over 8 evenly spaced columns, in fp64 (see roots.c) */
  double lambda_max; /* largest eigenvalue estimate of the input */
  double ridge;      /* absolute ridge added: epsilon * max(lambda_max, 1e-16) */
} pc_root_info;

/* Inverse p-th root of the symmetric PSD n x n dense matrix a (row-major, both triangles
 * valid) into x (n x n, caller-allocated, may not alias a). info may be NULL.
 * Returns PC_OK; PC_NOT_CONVERGED with x holding the best iterate and info->error its
 * error; PC_ENONFINITE_INPUT if a holds NaN/Inf (x untouched); PC_ENONFINITE_RESULT if the
 * result is not finite; PC_EINVAL, PC_ENOMEM or PC_ELAPACK. */
int pc_inverse_root_f32(size_t n, const float *a, float *x, const pc_root_opts *opts,
                        pc_root_info *info);
int pc_inverse_root_f64(size_t n, const double *a, double *x, const pc_root_opts *opts,
                        pc_root_info *info);

/* ------------------------------------------------------------------------------------ */
/* Inverse p-th roots in the steady state: warm-started from the previous eigenbasis      */

/* A statistic that moved a little since its last root is nearly diagonal in that root's
 * eigenbasis V (rows: eigenvectors): B = V A V^T. pc_inverse_root_warm_* computes B (in fp64
 * by default: it carries the ridge-level eigenvalues that fp32 products lose), and either
 * keeps V (the skip test, Distributed Shampoo's: |B - diag B|_F <= skip_tol |B|_F) or rotates
 * it by one Jacobi step on every pair at once followed by a Cholesky QR (a sweep), takes the
 * eigenvalues to second order from B, and assembles x = V^T diag((max(w, 0) + ridge)^(-1/p)) V
 * with the ridge rule of pc_inverse_root_*. An accuracy guard (B too far from diagonal for a
 * first-order step, or a failed orthonormalisation, or the sampled residual of x above
 * guard_tol) falls back to the cold root of opts->method (coupled Newton by default). docs/roots.md, "Steady state", has the costs. */

/* The held eigenbasis of one statistic: owned by the caller's struct, its buffers by
 * pc_eigbasis_init_* (freed by pc_eigbasis_destroy_*). */
typedef struct {
  size_t n;
  float *vt; /* n x n row-major, row j = eigenvector j */
  double *w; /* the n eigenvalues last computed with it (before the ridge) */
  int valid; /* 0: no basis yet (after init, or after a cold fallback dropped it) */
} pc_eigbasis_f32;

typedef struct {
  size_t n;
  double *vt;
  double *w;
  int valid;
} pc_eigbasis_f64;

/* Allocates the buffers of an n x n basis and marks it not valid. Returns PC_OK, PC_EINVAL
 * (NULL basis, n 0 or above the roots' limit) or PC_ENOMEM (basis left empty, so destroy on
 * it is harmless). */
int pc_eigbasis_init_f32(pc_eigbasis_f32 *basis, size_t n);
int pc_eigbasis_init_f64(pc_eigbasis_f64 *basis, size_t n);

/* Frees the buffers and leaves the basis empty. NULL, or calling it twice, is a no-op. */
void pc_eigbasis_destroy_f32(pc_eigbasis_f32 *basis);
void pc_eigbasis_destroy_f64(pc_eigbasis_f64 *basis);

/* Bytes an n x n basis holds (for memory budgets). */
size_t pc_eigbasis_bytes_f32(size_t n);
size_t pc_eigbasis_bytes_f64(size_t n);

/* Which path a steady-state root took. */
typedef enum {
  PC_WARM_SEEDED = 0, /* no basis held: one built by syevd, then refined like a warm one */
  PC_WARM_ROTATED,    /* the held basis rotated (sweeps) and the root rebuilt */
  PC_WARM_SKIPPED,    /* the skip test held: basis kept, eigenvalues refreshed from diag B */
  PC_WARM_REUSED,     /* the skip test held with reuse_root: x left as the caller had it */
  PC_WARM_COLD,       /* the guard fell back: opts->method's cold root, basis dropped */
  PC_WARM_EIGH        /* the eigh route (eigh_below): syevd on a, no B, the basis replaced */
} pc_warm_path;

/* Short lowercase name ("seeded", "rotated", "skipped", "reused", "cold", "eigh";
 * "unknown"). */
const char *pc_warm_path_name(pc_warm_path path);

typedef struct {
  double skip_tol;   /* keep the basis when |B - diag B|_F <= skip_tol |B|_F; default 1e-3;
                          0 never skips */
  int reuse_root;    /* 1: a skip leaves x untouched (x must hold the previous root);
                          0 (default): a skip rebuilds x from diag B */
  int sweeps;        /* rotations when the skip test fails (each one more B; the error
                          falls quadratically once the rotations are small); default 1; 1..16 */
  int wide;          /* fp32 only: 1 (default) forms B in fp64, 0 in fp32 */
  double max_change; /* guard: falls back at once when the off-diagonal part of B would
                          change the root by more than this, relative, to first order (the
                          held basis is too far; see pc_warm_info.change); default 0.05 */
  double guard_tol;  /* guard: falls back when the sampled residual max|x^p (A + ridge I) - I|
                          of the warm x exceeds it; default 0.25. A net for gross failures:
                          in fp32 at condition 1e6 good warm roots measure 0.03-0.06, but
                          the rounding of x alone can put an accurate root above 1 (cold
                          Newton's do; docs/roots.md), so it is no accuracy measure */
  double eigh_below; /* the eigh route: when a basis is held and eps32 * kappa, kappa the
                          condition of the held eigenvalues with the ridge, (max w + ridge) /
                          (max(min w, 0) + ridge), is below it, a plain syevd replaces the
                          rotation (fp32 eigh's error grows as about eps32 * kappa, the warm
                          path's does not: on a well-conditioned statistic eigh is both more
                          accurate and no dearer; docs/roots.md, "Session 17"); default 1e-4;
                          0 never takes it. fp32 only: the fp64 instance ignores it */
} pc_warm_opts;

/* Fills the defaults. NULL is a no-op. */
void pc_warm_opts_default(pc_warm_opts *opts);

typedef struct {
  pc_warm_path path;
  double offdiag;    /* |B - diag B|_F / |B|_F in the held basis (NAN when none was held) */
  double change;     /* first-order relative change of the root that B - diag B makes
                           (Daleckii-Krein; about the held root's error; NAN when none) */
  double residual;   /* the guard's sampled residual of the warm x (NAN if not reached) */
  pc_root_info root; /* the returned root: iters 0 unless cold; error = residual for warm
                           paths; lambda_max and ridge as pc_inverse_root_* */
} pc_warm_info;

/* Inverse p-th root of the symmetric PSD n x n a (row-major, both triangles valid) into x,
 * warm-started from basis (n must equal basis->n), which is updated to a's eigenbasis (or
 * dropped after a cold fallback). opts as for pc_inverse_root_*: p, epsilon, and for the
 * cold fallback tol, max_iters and method. wopts and info may be NULL (defaults, no report).
 * Returns what the path's root returned: PC_OK, PC_NOT_CONVERGED (cold only), or an error:
 * PC_EINVAL (bad sizes or options; nothing touched), PC_ENONFINITE_INPUT (basis and x
 * untouched), PC_ENONFINITE_RESULT, PC_ENOMEM, PC_ELAPACK. On an error the basis is dropped. */
int pc_inverse_root_warm_f32(size_t n, const float *a, float *x, const pc_root_opts *opts,
                             const pc_warm_opts *wopts, pc_eigbasis_f32 *basis, pc_warm_info *info);
int pc_inverse_root_warm_f64(size_t n, const double *a, double *x, const pc_root_opts *opts,
                             const pc_warm_opts *wopts, pc_eigbasis_f64 *basis, pc_warm_info *info);

/* ------------------------------------------------------------------------------------ */
/* Shampoo: block layout                                                                  */

/* A tensor of rank r >= 2 is viewed as a matrix rows = dims[0], cols = dims[1]*...*dims[r-1]
 * (a convolution weight [out, in, kh, kw] becomes out x (in*kh*kw)); a rank-1 tensor's view
 * is dims[0] x 1. The view is row-major: element (i, j) is at i*cols + j of the tensor's
 * row-major storage. It is cut into blocks of at most block_size x block_size: each axis
 * in pieces of block_size from 0, the last piece holding the remainder; blocks are listed
 * row-major over the tiles (block k = tile (k / tiles_per_row, k % tiles_per_row)).
 * A rank-1 tensor, or one whose rows or cols exceed skip_limit, is diagonal: no factors,
 * the grafted (diagonal) step only (pc_graft_direction_f32 over the whole tensor). Every
 * worker and daemon computes the same layout from the same shape and options. */
typedef struct {
  size_t block_size; /* default 128; >= 1 */
  size_t skip_limit; /* default 4096; >= 1 */
} pc_layout_opts;

/* Fills the defaults. NULL is a no-op. */
void pc_layout_opts_default(pc_layout_opts *opts);

typedef struct {
  size_t row0, rows; /* rows of the 2-D view covered by this block */
  size_t col0, cols; /* columns of the 2-D view covered by this block */
} pc_block;

typedef struct {
  size_t rows, cols; /* the 2-D view */
  int diagonal;      /* 1: no blocks (nblocks == 0) */
  size_t nblocks;
  pc_block *blocks; /* owned by the layout; freed by pc_layout_destroy */
} pc_layout;

/* Computes the layout of a tensor of the given rank and dims. On success the caller owns
 * layout and must call pc_layout_destroy. Returns PC_EINVAL for a NULL layout or dims,
 * rank < 1, a zero dim, a zero block_size or skip_limit, or dims whose product overflows
 * size_t; PC_ENOMEM. opts may be NULL for the defaults. On failure *layout is left empty
 * (nblocks 0, blocks NULL), so pc_layout_destroy on it is harmless. */
int pc_layout_init(pc_layout *layout, int rank, const size_t *dims, const pc_layout_opts *opts);

/* Stores in *nblocks the number of blocks pc_layout_init would make for the same arguments
 * (0 for a diagonal tensor), in O(rank) and without allocating: for callers that must bound
 * a job's size before laying it out. Returns pc_layout_init's errors except PC_ENOMEM, and
 * PC_EINVAL for a NULL nblocks; *nblocks is 0 on failure. */
int pc_layout_count(int rank, const size_t *dims, const pc_layout_opts *opts, size_t *nblocks);

/* Frees the blocks and leaves the layout empty. NULL, or calling it twice, is a no-op. */
void pc_layout_destroy(pc_layout *layout);

/* Shampoo's root rate (precondd's shampoo.root_every), the one rule that the daemon and the
 * worker share: block id's statistics steps fall into windows of `every` steps, offset by
 * the id so that a job's blocks (pushed together every step) take turns instead of all
 * computing on the same step; precondd computes a block's roots at its first push in a
 * window. pc_root_window is the window of step; pc_root_window_start its first step (0 for
 * the first, shorter window), so the window's roots are those from a step at or after it.
 * every 0 is taken as 1 (a window per step). */
uint64_t pc_root_window(uint64_t step, uint64_t id, uint64_t every);
uint64_t pc_root_window_start(uint64_t step, uint64_t id, uint64_t every);

/* ------------------------------------------------------------------------------------ */
/* Shampoo: statistics and direction                                                      */

/* Packed Gram matrices of one block g (rows x cols, row stride ld, row-major):
 * left = g g^T (rows x rows), right = g^T g (cols x cols), each packed upper
 * (pc_packed_len(rows) and pc_packed_len(cols) values, caller-allocated).
 * Either output may be NULL to skip it. A block of a tensor's 2-D view (see pc_layout) is
 * g = view + row0 * cols + col0 with ld = cols of the view. NaN or Inf in g propagate to
 * the output (the daemon rejects them on push). Returns PC_OK; PC_EINVAL for rows or
 * cols 0, g NULL, ld < cols or a dim above INT_MAX (BLAS takes int); PC_ENOMEM (scratch of
 * max(rows, cols)^2 values). */
int pc_gram_f32(size_t rows, size_t cols, const float *g, size_t ld, float *left_packed,
                float *right_packed);
int pc_gram_f64(size_t rows, size_t cols, const double *g, size_t ld, double *left_packed,
                double *right_packed);

/* Statistic update on packed storage of count values: s <- beta2 s + (1 - beta2) inc,
 * except beta2 == 1, which sums: s <- s + inc. beta2 must be in [0, 1]; the caller checks
 * it once where it is configured (these run every step and cannot fail). s and inc may
 * not overlap unless equal. NULL s or inc is a no-op. */
void pc_stat_update_f32(size_t count, float *s, const float *inc, float beta2);
void pc_stat_update_f64(size_t count, double *s, const double *inc, double beta2);

/* Preconditioned direction of one block: p = lroot g rroot, where lroot is rows x rows and
 * rroot cols x cols (dense row-major); g and p are rows x cols with row stride ld.
 * Either root may be NULL, meaning the identity (one-sided preconditioning); with both
 * NULL, p = g. For Shampoo lroot = L^(-1/4) and rroot = R^(-1/4) (pc_inverse_root_*).
 * p may be g itself (in place); otherwise p may not overlap g, and no root may overlap p.
 * Returns PC_OK; PC_EINVAL for rows or cols 0, g or p NULL, ld < cols, a dim above
 * INT_MAX, or overlapping buffers as above; PC_ENOMEM (a rows x cols scratch when both
 * roots are given or p is g). */
int pc_direction_f32(size_t rows, size_t cols, const float *lroot, const float *g, size_t ld,
                     const float *rroot, float *p);
int pc_direction_f64(size_t rows, size_t cols, const double *lroot, const double *g, size_t ld,
                     const double *rroot, double *p);

/* ------------------------------------------------------------------------------------ */
/* Grafting and the diagonal step                                                         */

/* The grafting rules, elementwise over the count values of one call, at step t >= 1.
 * |g| is the Frobenius norm of those count values, so normalisation is per call: call per
 * block to graft block by block, per tensor for a diagonal tensor. gn = g / |g|, and
 * gn = 0 when |g| = 0. b1, b2, eps come from pc_graft_opts; c1 = 1 - b1^t, c2 = 1 - b2^t.
 *   SGD:              d = g
 *   ADAGRAD:          v <- v + g^2;                        d = g / (sqrt(v) + eps)
 *   RMSPROP_NORMED:   v <- b2 v + (1-b2) gn^2;             d = gn / (sqrt(v) + eps)
 *                     (no bias correction: Lingvo's rule)
 *   ADAM_NORMED:      m <- b1 m + (1-b1) gn;  v <- b2 v + (1-b2) gn^2;
 *                     d = (m / c1) / (sqrt(v / c2) + eps)
 *   RMSPROP:          v <- b2 v + (1-b2) g^2;              d = g / (sqrt(v / c2) + eps)
 *   ADAM:             m <- b1 m + (1-b1) g;   v <- b2 v + (1-b2) g^2;
 *                     d = (m / c1) / (sqrt(v / c2) + eps)   (Adam, Kingma & Ba 2015)
 * The plain RMSPROP and ADAM are Distributed Shampoo's grafts (Shi et al. 2023): without
 * the normalisation their step length is the optimizer's own, and the bias correction keeps
 * the first steps from being 1/sqrt(1 - b2) too large.
 * State m, v is fp32; arithmetic is fp64 and rounded on store. */
typedef enum {
  PC_GRAFT_SGD = 0,        /* d = g */
  PC_GRAFT_ADAGRAD,        /* v += g^2;                     d = g / (sqrt(v) + eps) */
  PC_GRAFT_RMSPROP_NORMED, /* gn = g/|g|; v = b2 v + (1-b2) gn^2; d = gn / (sqrt(v) + eps) */
  PC_GRAFT_ADAM_NORMED, /* gn = g/|g|; m, v Adam moments of gn (bias-corrected); d = m / (sqrt(v)+eps) */
  PC_GRAFT_RMSPROP, /* v = b2 v + (1-b2) g^2;  d = g / (sqrt(v / c2) + eps) */
  PC_GRAFT_ADAM     /* m, v Adam moments of g (bias-corrected) */
} pc_graft;

#define PC_GRAFT_COUNT 6 /* the kinds above are 0 .. PC_GRAFT_COUNT - 1 */

/* Short lowercase name ("sgd", "adagrad", "rmsprop-normed", "adam-normed", "rmsprop",
 * "adam"); "unknown" for a value outside the enum. Never NULL. */
const char *pc_graft_name(pc_graft kind);

typedef struct {
  pc_graft kind;
  double beta1; /* Adam first moment; default 0.9; [0, 1) */
  double beta2; /* second moment; default 0.999; [0, 1) */
  double eps;   /* default 1e-8; > 0 (unused by SGD) */
} pc_graft_opts;

/* Fills the defaults for kind. NULL is a no-op. */
void pc_graft_opts_default(pc_graft_opts *opts, pc_graft kind);

/* The grafted (diagonal) direction of count values of gradient g into d, updating the
 * caller-owned state (m and v, count values each, zero-initialised by the caller; m is
 * used only by Adam, v by all but SGD; unused ones may be NULL). step counts from 1.
 * d may be g itself (in place); m, v and d may not overlap otherwise.
 * Returns PC_OK; PC_EINVAL for count 0, g, d or opts NULL, step < 1, an unknown kind, a
 * needed state NULL, or a beta or eps out of range; PC_ENONFINITE_INPUT if g holds NaN or
 * Inf (checked first: state and d untouched). */
int pc_graft_direction_f32(size_t count, const float *g, const pc_graft_opts *opts, long step,
                           float *m, float *v, float *d);

/* Rescales p in place to the Frobenius norm of d (the grafted norm): p *= |d| / |p|.
 * If |p| is 0 or not finite, p becomes d (a direction with no usable norm is replaced by
 * the grafted step). NULL p or d is a no-op. Norms are taken in fp64. */
void pc_graft_rescale_f32(size_t count, float *p, const float *d);

/* pc_graft_rescale_f32 on one block of a 2-D view, in place: the rows x cols block at p
 * (row stride ldp) gets the Frobenius norm of the block at d (row stride ldd), or becomes
 * it if its own norm is 0 or not finite. Lets a worker graft block by block without
 * gathering blocks: take D = pc_graft_direction_f32 over the whole tensor (contiguous),
 * write each block's P with pc_direction_* (ld = the view's cols) into a full-size
 * buffer, then rescale each block against the same block of D (both at row0 * cols +
 * col0, ld = cols). Returns PC_OK, or PC_EINVAL for rows or cols 0, NULL p or d, ldp or
 * ldd < cols. */
int pc_graft_rescale_block_f32(size_t rows, size_t cols, float *p, size_t ldp, const float *d,
                               size_t ldd);

/* ------------------------------------------------------------------------------------ */
/* K-FAC: factors, damping, damped inverses, eigen form, update, KL clipping              */
/*                                                                                          */
/* Martens & Grosse 2015; Grosse & Martens 2016 (convolutions); Osawa et al. 2018; KAISA    */
/* (Pauloski et al. 2021). A layer with gradient matrix W_grad (out x in; the bias, if any,  */
/* as a last column) has factors A (in x in, input covariance, a 1 appended for the bias)   */
/* and G (out x out, output-gradient covariance), kept packed upper (pc_pack_f32's layout). */
/* docs/kfac.md has the formulas, the normalisations and the measured method choice.        */

/* How a damped factor is inverted. */
typedef enum {
  PC_KFAC_INV_CHOLESKY = 0, /* LAPACK potrf + potri */
  PC_KFAC_INV_EIGH,         /* LAPACK syevd, then Q diag(1 / (max(v, 0) + damping)) Q^T */
  PC_KFAC_INV_NEWTON        /* precond's coupled Newton (pc_inverse_root_*) with p = 1 */
} pc_kfac_inv;

/* Short lowercase name ("cholesky", "eigh", "newton"); "unknown" outside the enum. */
const char *pc_kfac_inv_name(pc_kfac_inv method);

/* Every K-FAC default lives here (algorithms note, section 3). */
typedef struct {
  double factor_decay;     /* xi of F <- xi F + (1 - xi) F_batch; 0.95; [0, 1) */
  double damping;          /* lambda (Tikhonov); 1e-3; > 0 */
  int pi_damping;          /* 1: split lambda between A and G by pi (pc_kfac_damping_split);
                               0: pi = 1. Default 1 */
  double kl_clip;          /* c of the KL clip (pc_kfac_kl_scale); 3e-4; > 0 */
  int kl_base_lr;          /* 1: the clip's lr is the run's base (peak) rate, so it bounds the
                               unscheduled step and the schedule (warm-up, decay) scales the
                               clipped step; 0: the step's own rate (KAISA), under which a
                               clipped step ignores the schedule (docs/kfac.md). Default 1 */
  long inv_every;          /* inverses recomputed every this many factor folds; 10; >= 1 */
  long factor_every_first; /* factors every this many steps in the first epochs; 1; >= 1 */
  long factor_every;       /* ... and every this many after them (Osawa's stale schedule);
                               10; >= 1 */
  long first_epochs;       /* epochs at factor_every_first; 1; >= 0 */
  size_t eigh_min_n;       /* pc_kfac_inv_for_size: factors of order >= this use eigh, the
                               smaller ones Cholesky (measured, docs/kfac.md); >= 1 */
} pc_kfac_opts;

/* Fills the defaults. NULL is a no-op. */
void pc_kfac_opts_default(pc_kfac_opts *opts);

/* PC_OK, or PC_EINVAL for NULL or a field outside the ranges above. */
int pc_kfac_opts_check(const pc_kfac_opts *opts);

/* 1 if factors are due at step (>= 1) for a run of steps_per_epoch (>= 1) steps per epoch,
 * else 0: steps 1, 1 + f, 1 + 2f, ... with f = factor_every_first up to the end of epoch
 * first_epochs, then every factor_every steps counted from the first step after it. For
 * opts that passed pc_kfac_opts_check; a step < 1 or steps_per_epoch < 1 gives 0. */
int pc_kfac_factor_due(const pc_kfac_opts *opts, long step, long steps_per_epoch);

/* The inverse method for a factor of order n under opts (eigh_min_n). */
pc_kfac_inv pc_kfac_inv_for_size(const pc_kfac_opts *opts, size_t n);

/* Folds a batch factor into the running average, count packed values each:
 * first != 0: f = batch (the first fold takes the batch factor as is: docs/kfac.md says why);
 * else f <- decay f + (1 - decay) batch (pc_stat_update_*). decay in [0, 1) is checked where
 * it is configured (pc_kfac_opts_check). f and batch may not overlap unless equal. NULL f or
 * batch is a no-op. */
void pc_kfac_fold_f32(size_t count, float *f, const float *batch, double decay, int first);
void pc_kfac_fold_f64(size_t count, double *f, const double *batch, double decay, int first);

/* Trace of the packed upper n x n matrix, summed in fp64. NULL or n == 0 gives 0. */
double pc_kfac_trace_f32(size_t n, const float *packed);
double pc_kfac_trace_f64(size_t n, const double *packed);

/* The damping of one layer's two factors. */
typedef struct {
  double pi;       /* sqrt((tr A / dim A) / (tr G / dim G)), or 1 (see pi_fallback) */
  double damp_a;   /* pi sqrt(lambda): A's inverse is (A + damp_a I)^-1 */
  double damp_g;   /* sqrt(lambda) / pi: G's inverse is (G + damp_g I)^-1 */
  int pi_fallback; /* 1: a trace was not positive (a dead layer or an all-zero factor), or
                      pi came out 0 or not finite, so pi = 1 was used */
} pc_kfac_damping;

/* pi-damping (Martens & Grosse 2015, section 6.3) from the traces of A (order dim_a) and G
 * (order dim_g). use_pi == 0 gives pi = 1. Returns PC_OK; PC_EINVAL for a NULL out, a zero
 * dim, lambda not positive and finite; PC_ENONFINITE_INPUT for a trace that is NaN or Inf
 * (out untouched). */
int pc_kfac_damping_split(size_t dim_a, double tr_a, size_t dim_g, double tr_g, double lambda,
                          int use_pi, pc_kfac_damping *out);

typedef struct {
  pc_kfac_inv method; /* the method used */
  int iters;          /* Newton steps (0 for Cholesky and eigh) */
  double error;       /* Newton: its max|M - I|; Cholesky, eigh: max|X (F + d I) - I| over 8
                          evenly spaced columns, in fp64 (pc_inverse_root's eigh measure) */
} pc_kfac_inv_info;

/* X = (F + damping I)^-1 of the symmetric PSD factor F (order n, packed upper) into x
 * (dense n x n row-major, both triangles; caller-allocated). damping >= 0 and finite.
 * info may be NULL. Returns PC_OK; PC_NOT_CONVERGED (Newton: x holds its best iterate);
 * PC_EINVAL (n 0 or above 46340, NULL f or x, bad damping or method); PC_ENONFINITE_INPUT
 * (x untouched); PC_ELAPACK (Cholesky: F + damping I is not positive definite); PC_ENOMEM;
 * PC_ENONFINITE_RESULT. */
int pc_kfac_inverse_f32(size_t n, const float *f, double damping, pc_kfac_inv method, float *x,
                        pc_kfac_inv_info *info);
int pc_kfac_inverse_f64(size_t n, const double *f, double damping, pc_kfac_inv method, double *x,
                        pc_kfac_inv_info *info);

/* Eigen form of a factor (KAISA's default): F = Q diag(v) Q^T, F of order n packed upper;
 * q (n x n row-major, eigenvector j in COLUMN j) and v (n values, ascending, negative
 * rounding noise clamped to 0) are caller-allocated. Returns PC_OK; PC_EINVAL (n 0 or above
 * 46340, NULL argument); PC_ENONFINITE_INPUT; PC_ELAPACK; PC_ENOMEM. */
int pc_kfac_eigen_f32(size_t n, const float *f, float *q, float *v);
int pc_kfac_eigen_f64(size_t n, const double *f, double *q, double *v);

/* The K-FAC update of one layer from the inverses: p = g_inv grad a_inv, grad and p
 * out x in with row stride ld, g_inv out x out and a_inv in x in dense. The same product as
 * pc_direction_* (one source): same contract and errors. */
int pc_kfac_update_f32(size_t out, size_t in, const float *g_inv, const float *grad, size_t ld,
                       const float *a_inv, float *p);
int pc_kfac_update_f64(size_t out, size_t in, const double *g_inv, const double *grad, size_t ld,
                       const double *a_inv, double *p);

/* The K-FAC update of one layer from the eigen forms (pc_kfac_eigen_*):
 *   p = Q_G [(Q_G^T grad Q_A) / (v_G v_A^T + lambda)] Q_A^T  (elementwise division),
 * grad and p out x in with row stride ld (p may be grad), qg out x out, vg out values, qa
 * in x in, va in values. lambda >= 0 and finite; a zero denominator gives Inf/NaN in p.
 * Returns PC_OK; PC_EINVAL (a zero or too large dim, NULL argument, ld < in, bad lambda);
 * PC_ENOMEM (two out x in scratch matrices). */
int pc_kfac_eigen_update_f32(size_t out, size_t in, const float *qg, const float *vg,
                             const float *grad, size_t ld, const float *qa, const float *va,
                             double lambda, float *p);
int pc_kfac_eigen_update_f64(size_t out, size_t in, const double *qg, const double *vg,
                             const double *grad, size_t ld, const double *qa, const double *va,
                             double lambda, double *p);

/* sum_i a[i] b[i] in fp64: the <P_l, grad_l> of one layer for pc_kfac_kl_scale. */
double pc_kfac_dot_f32(size_t count, const float *a, const float *b);

/* KL clipping (KAISA; Ba et al. 2017): *nu = min(1, sqrt(kl_clip / |lr^2 vg_sum|)) with
 * vg_sum = sum over layers of <P_l, grad_l>; every preconditioned gradient is then scaled by
 * nu. *nu = 1 when lr^2 vg_sum is 0. Returns PC_OK; PC_EINVAL (NULL nu, kl_clip not
 * positive and finite, lr negative or not finite); PC_ENONFINITE_INPUT (vg_sum NaN or Inf:
 * *nu = 0, so that a caller that ignores the status applies no step). */
int pc_kfac_kl_scale(double kl_clip, double lr, double vg_sum, double *nu);

/* ------------------------------------------------------------------------------------ */
/* ABS / ABSA: the top Hessian eigenvalue and the adaptive-batch rule                     */
/*                                                                                          */
/* Yao, Gholami, Lei, Keutzer, Mahoney 2018 (algorithms note, section 4; docs/abs.md). The  */
/* Hessian-vector products come from elsewhere (the worker's device): the power iteration   */
/* here is driven one product at a time (pc_abs_power_step), so that whoever holds its     */
/* state (the daemon) never needs the model. Vectors are fp32 with fp64 sums.              */

/* Every ABS/ABSA default lives here (algorithms note, section 4). */
typedef struct {
  int power_max_iters;       /* power-iteration steps per estimate; 10; >= 1 */
  double power_tol;          /* relative change of lambda that stops it; 1e-2; >= 0 */
  uint64_t seed;             /* start vector seed (fixed: reproducible); 1 */
  uint32_t base_batch;       /* batch at the start; 128; >= 1 */
  uint32_t max_batch_factor; /* the batch grows up to base_batch times this; 128; >= 1 */
  uint32_t growth_epochs;    /* forced growth after this many epochs without one; 10; >= 1 */
  double ref_ratio;          /* grow when lambda <= ref_ratio * lambda_ref; 0.5; in (0, 1] */
  double adv_fraction;       /* ABSA's FGSM share of a batch at the start; 0.2; [0, 1] (ABS:
                                0, set by the caller) */
  double adv_eps;            /* FGSM step on [0, 1] pixels; 0.005; >= 0 */
  double hv_rel_step;        /* h of the central difference is hv_rel_step * max(||w||, 1)
                                for a unit probe: ours, not published (docs/abs.md); 1e-3;
                                > 0 */
  uint32_t hv_batch;         /* samples of the batch the eigenvalue is measured on; 128; >= 1 */
} pc_abs_opts;

/* Fills the defaults. NULL is a no-op. */
void pc_abs_opts_default(pc_abs_opts *opts);

/* PC_OK, or PC_EINVAL for NULL or a field outside the ranges above (and a largest batch,
 * base_batch * max_batch_factor, above UINT32_MAX). */
int pc_abs_opts_check(const pc_abs_opts *opts);

/* The state of one power iteration on a Hessian of order n. The caller owns v (n floats)
 * and keeps it for the life of the state: it holds the probe the next product is taken of. */
typedef struct {
  size_t n;
  float *v;      /* the current unit probe */
  double lambda; /* the latest estimate <Hv, v>; NaN before the first product */
  int iters;     /* products folded in since pc_abs_power_start */
  int done;      /* 1: converged (PC_OK) or at the step cap (PC_NOT_CONVERGED) */
  int status;    /* PC_OK or PC_NOT_CONVERGED once done; PC_NOT_CONVERGED before */
} pc_abs_power;

/* Starts an estimate: v (n floats, caller-owned) gets a fixed-seed random unit vector
 * (seed's stream, independent of n's other uses), lambda NaN, iters 0, done 0. Returns
 * PC_OK or PC_EINVAL (NULL p or v, n 0). */
int pc_abs_power_start(pc_abs_power *p, size_t n, float *v, uint64_t seed);

/* Folds in hv = H v for the current probe: lambda = <hv, v>; the estimate is done when lambda
 * moved by at most power_tol relative to the previous one (PC_OK), or at power_max_iters
 * products (PC_NOT_CONVERGED); otherwise v = hv / ||hv|| is the next probe. A zero hv is an
 * exact answer (lambda 0, done, PC_OK). Returns PC_OK (folded in), PC_EINVAL (NULL argument,
 * a state already done), PC_ENONFINITE_INPUT (NaN or Inf in hv: the state is unchanged). */
int pc_abs_power_step(pc_abs_power *p, const pc_abs_opts *opts, const float *hv);

/* The adaptive-batch rule's state for one run. */
typedef struct {
  uint32_t batch;               /* the batch size now */
  double lr_scale;              /* batch / base_batch: the learning rate's factor */
  double adv_fraction;          /* ABSA's FGSM share now (before pc_abs_adv_fraction's cut) */
  double lambda_ref;            /* NaN until the first eigenvalue */
  uint32_t epochs_since_growth; /* epochs the rule ran since the last growth (or the start) */
  uint32_t growths;
} pc_abs_rule;

/* What one epoch's evaluation decided. */
typedef enum {
  PC_ABS_KEPT = 0,    /* the batch stays */
  PC_ABS_REFERENCE,   /* the first eigenvalue became lambda_ref; the batch stays */
  PC_ABS_GREW_FLAT,   /* lambda <= ref_ratio * lambda_ref: lambda_ref = lambda, grown */
  PC_ABS_GREW_FORCED, /* growth_epochs epochs without growth: grown */
  PC_ABS_AT_MAX       /* the batch is at its maximum: the rule no longer runs */
} pc_abs_decision;

/* Short lowercase name ("kept", "reference", "grew-flat", "grew-forced", "at-max"). */
const char *pc_abs_decision_name(pc_abs_decision d);

/* The start: batch base_batch, lr_scale 1, adv_fraction opts->adv_fraction, no reference.
 * For opts that passed pc_abs_opts_check. */
void pc_abs_rule_init(pc_abs_rule *r, const pc_abs_opts *opts);

/* 1 while the rule still runs (the batch below its maximum): only then is an eigenvalue
 * worth measuring. */
int pc_abs_rule_active(const pc_abs_rule *r, const pc_abs_opts *opts);

/* One epoch boundary with the epoch's top eigenvalue lambda (its magnitude counts: the power
 * iteration's dominant eigenvalue may be negative; lambda_ref holds magnitudes). Growing
 * doubles the batch
 * (capped at base_batch * max_batch_factor), scales lr_scale by the same ratio and halves
 * adv_fraction. Returns PC_OK with *decision; PC_EINVAL (NULL argument);
 * PC_ENONFINITE_INPUT (lambda NaN or Inf: r unchanged). */
int pc_abs_rule_epoch(pc_abs_rule *r, const pc_abs_opts *opts, double lambda,
                      pc_abs_decision *decision);

/* ABSA's FGSM share at progress (the fraction of the run's samples done, in [0, 1]): r's
 * fraction in the first half, 0 from progress 0.5 on (the paper switches it off for the
 * second half of training; counted in samples, not epochs, so that short runs halve too).
 * NULL r or a progress that is NaN gives 0. */
double pc_abs_adv_fraction(const pc_abs_rule *r, double progress);

#ifdef __cplusplus
}
#endif

#endif /* PRECOND_PRECONDITIONER_H */
