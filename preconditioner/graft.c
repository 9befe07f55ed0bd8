/*
 * graft.c -- grafting (Agarwal et al., "Disentangling Adaptive Gradient Methods from
 * Learning Rates", 2020; used by Anil et al. 2020): a simple diagonal optimizer supplies
 * the step length, Shampoo the step direction. The same diagonal direction is the whole
 * step for tensors that have no factors (rank 1, or a dim above the skip limit) and for
 * blocks whose first root is not ready yet.
 *
 * State is fp32 like the gradients; norms, moments' bias corrections and the rescaling
 * factor are taken in fp64 so that a large block does not lose its norm to rounding.
 */
#include <math.h>
#include <stddef.h>

#include "preconditioner.h"

const char *pc_graft_name(pc_graft kind) {
  switch (kind) {
    case PC_GRAFT_SGD:
      return "sgd";
    case PC_GRAFT_ADAGRAD:
      return "adagrad";
    case PC_GRAFT_RMSPROP_NORMED:
      return "rmsprop-normed";
    case PC_GRAFT_ADAM_NORMED:
      return "adam-normed";
    case PC_GRAFT_RMSPROP:
      return "rmsprop";
    case PC_GRAFT_ADAM:
      return "adam";
  }
  return "unknown";
}

void pc_graft_opts_default(pc_graft_opts *opts, pc_graft kind) {
  if (opts == NULL) return;
  opts->kind = kind;
  opts->beta1 = 0.9;
  opts->beta2 = 0.999;
  opts->eps = 1e-8;
}

/* ------------------------------------------------------------------------------------ */
/* Argument checks                                                                        */

static int graft_check(size_t count, const float *g, const pc_graft_opts *opts, long step,
                       const float *m, const float *v, const float *d) {
  if (count == 0 || g == NULL || d == NULL || opts == NULL || step < 1) return PC_EINVAL;
  switch (opts->kind) {
    case PC_GRAFT_SGD:
      break;
    case PC_GRAFT_ADAM_NORMED:
    case PC_GRAFT_ADAM:
      /* Adam needs everything RMSprop needs, and m. */
      if (m == NULL || !(opts->beta1 >= 0.0 && opts->beta1 < 1.0)) return PC_EINVAL;
      /* fall through */
    case PC_GRAFT_RMSPROP_NORMED:
    case PC_GRAFT_RMSPROP:
      if (!(opts->beta2 >= 0.0 && opts->beta2 < 1.0)) return PC_EINVAL;
      /* fall through */
    case PC_GRAFT_ADAGRAD:
      /* eps > 0 keeps d finite where v is still 0 */
      if (v == NULL || !(opts->eps > 0.0 && isfinite(opts->eps))) return PC_EINVAL;
      break;
    default:
      return PC_EINVAL;
  }
  if (!pc_all_finite_f32(count, g)) return PC_ENONFINITE_INPUT;
  return PC_OK;
}

/* ------------------------------------------------------------------------------------ */
/* Kernels                                                                                */

/* Frobenius norm of a rows x cols block with row stride ld, in fp64. */
static double block_norm(size_t rows, size_t cols, const float *x, size_t ld) {
  double s = 0.0;
  for (size_t i = 0; i < rows; i++)
    for (size_t j = 0; j < cols; j++) s += (double)x[i * ld + j] * x[i * ld + j];
  return sqrt(s);
}

/* 1/|g|, or 0 for a zero gradient (whose normalised form is taken to be 0, not NaN). */
static double inv_norm(size_t count, const float *g) {
  double n = block_norm(1, count, g, count);
  return n > 0.0 ? 1.0 / n : 0.0;
}

static void adagrad(size_t count, const float *g, double eps, float *v, float *d) {
  for (size_t i = 0; i < count; i++) {
    v[i] = (float)((double)v[i] + (double)g[i] * g[i]);
    d[i] = (float)(g[i] / (sqrt((double)v[i]) + eps));
  }
}

/* RMSprop (m NULL) or Adam of x = g * s: s = 1/|g| for the normed kinds, 1 for the plain
 * ones. bias says whether v is bias-corrected (all but Lingvo's RMSPROP_NORMED). */
static void moments(size_t count, const float *g, double s, double beta1, double beta2, double eps,
                    long step, int bias, float *m, float *v, float *d) {
  const double c1 = 1.0 - pow(beta1, (double)step);
  const double c2 = bias ? 1.0 - pow(beta2, (double)step) : 1.0;
  for (size_t i = 0; i < count; i++) {
    double x = g[i] * s;
    v[i] = (float)(beta2 * v[i] + (1.0 - beta2) * x * x);
    if (m != NULL) {
      m[i] = (float)(beta1 * m[i] + (1.0 - beta1) * x);
      x = m[i] / c1;
    }
    d[i] = (float)(x / (sqrt(v[i] / c2) + eps));
  }
}

int pc_graft_direction_f32(size_t count, const float *g, const pc_graft_opts *opts, long step,
                           float *m, float *v, float *d) {
  int rc = graft_check(count, g, opts, step, m, v, d);
  if (rc != PC_OK) return rc;
  switch (opts->kind) {
    case PC_GRAFT_SGD:
      for (size_t i = 0; i < count; i++) d[i] = g[i];
      break;
    case PC_GRAFT_ADAGRAD:
      adagrad(count, g, opts->eps, v, d);
      break;
    case PC_GRAFT_RMSPROP_NORMED:
      moments(count, g, inv_norm(count, g), 0.0, opts->beta2, opts->eps, step, 0, NULL, v, d);
      break;
    case PC_GRAFT_ADAM_NORMED:
      moments(count, g, inv_norm(count, g), opts->beta1, opts->beta2, opts->eps, step, 1, m, v, d);
      break;
    case PC_GRAFT_RMSPROP:
      moments(count, g, 1.0, 0.0, opts->beta2, opts->eps, step, 1, NULL, v, d);
      break;
    case PC_GRAFT_ADAM:
      moments(count, g, 1.0, opts->beta1, opts->beta2, opts->eps, step, 1, m, v, d);
      break;
  }
  return PC_OK;
}

/* The kernel of both rescaling forms: a contiguous vector is one row. */
static void rescale(size_t rows, size_t cols, float *p, size_t ldp, const float *d, size_t ldd) {
  const double np = block_norm(rows, cols, p, ldp), nd = block_norm(rows, cols, d, ldd);
  if (np == 0.0 || !isfinite(np)) {
    for (size_t i = 0; i < rows; i++)
      for (size_t j = 0; j < cols; j++) p[i * ldp + j] = d[i * ldd + j];
    return;
  }
  const double scale = nd / np;
  for (size_t i = 0; i < rows; i++)
    for (size_t j = 0; j < cols; j++) p[i * ldp + j] = (float)(p[i * ldp + j] * scale);
}

void pc_graft_rescale_f32(size_t count, float *p, const float *d) {
  if (p == NULL || d == NULL || count == 0) return;
  rescale(1, count, p, count, d, count);
}

int pc_graft_rescale_block_f32(size_t rows, size_t cols, float *p, size_t ldp, const float *d,
                               size_t ldd) {
  if (rows == 0 || cols == 0 || p == NULL || d == NULL || ldp < cols || ldd < cols)
    return PC_EINVAL;
  rescale(rows, cols, p, ldp, d, ldd);
  return PC_OK;
}
