/*
 * shampoo.c -- Shampoo's per-block statistics and preconditioned direction
 * (Gupta, Koren, Singer 2018; Anil et al. 2020, section 3):
 *
 *   L <- beta2 L + (1 - beta2) G G^T,   R <- beta2 R + (1 - beta2) G^T G,
 *   P  = L^(-1/4) G R^(-1/4).
 *
 * The roots come from roots.c (or the daemon); here they are plain dense matrices.
 */
#include <cblas.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "preconditioner.h"

/* ------------------------------------------------------------------------------------ */
/* Argument checks                                                                        */

static int gram_check(size_t rows, size_t cols, const void *g, size_t ld) {
  if (rows == 0 || cols == 0 || g == NULL || ld < cols) return PC_EINVAL;
  /* cblas takes int dimensions. */
  if (rows > INT32_MAX || cols > INT32_MAX || ld > INT32_MAX) return PC_EINVAL;
  size_t n = rows > cols ? rows : cols;
  if (n > SIZE_MAX / n / sizeof(double)) return PC_EINVAL;
  return PC_OK;
}

/* True when the byte ranges [a, a + na) and [b, b + nb) intersect. Compared as integers:
 * relational operators on pointers into different objects are undefined. */
static int ranges_overlap(const void *a, size_t na, const void *b, size_t nb) {
  uintptr_t pa = (uintptr_t)a, pb = (uintptr_t)b;
  return pa < pb + nb && pb < pa + na;
}

/* Bytes spanned by a rows x cols matrix with row stride ld. */
static size_t span(size_t rows, size_t cols, size_t ld, size_t sz) {
  return ((rows - 1) * ld + cols) * sz;
}

static int direction_check(size_t rows, size_t cols, const void *lroot, const void *g,
                           size_t ld, const void *rroot, const void *p, size_t sz) {
  if (rows == 0 || cols == 0 || g == NULL || p == NULL || ld < cols) return PC_EINVAL;
  if (rows > INT32_MAX || cols > INT32_MAX || ld > INT32_MAX) return PC_EINVAL;
  if (rows > SIZE_MAX / ld / sz || rows > SIZE_MAX / rows / sz || cols > SIZE_MAX / cols / sz)
    return PC_EINVAL;
  size_t np = span(rows, cols, ld, sz);
  /* p == g is in-place and fine; a shifted overlap would be read after it is written. */
  if (p != g && ranges_overlap(p, np, g, np)) return PC_EINVAL;
  /* A root that shares memory with p would be overwritten while it is read. */
  if (lroot != NULL && ranges_overlap(lroot, rows * rows * sz, p, np)) return PC_EINVAL;
  if (rroot != NULL && ranges_overlap(rroot, cols * cols * sz, p, np)) return PC_EINVAL;
  return PC_OK;
}

/* ------------------------------------------------------------------------------------ */
/* Gram matrices                                                                          */

int pc_gram_f32(size_t rows, size_t cols, const float *g, size_t ld, float *left_packed,
                float *right_packed) {
  int rc = gram_check(rows, cols, g, ld);
  if (rc != PC_OK) return rc;
  size_t n = rows > cols ? rows : cols;
  float *c = malloc(n * n * sizeof *c);
  if (c == NULL) return PC_ENOMEM;

  /* syrk fills the upper triangle only: exactly what the packed form keeps. */
  if (left_packed != NULL) {
    cblas_ssyrk(CblasRowMajor, CblasUpper, CblasNoTrans, (int)rows, (int)cols, 1.0f, g,
                (int)ld, 0.0f, c, (int)rows);
    pc_pack_f32(rows, c, left_packed);
  }
  if (right_packed != NULL) {
    cblas_ssyrk(CblasRowMajor, CblasUpper, CblasTrans, (int)cols, (int)rows, 1.0f, g,
                (int)ld, 0.0f, c, (int)cols);
    pc_pack_f32(cols, c, right_packed);
  }
  free(c);
  return PC_OK;
}

int pc_gram_f64(size_t rows, size_t cols, const double *g, size_t ld, double *left_packed,
                double *right_packed) {
  int rc = gram_check(rows, cols, g, ld);
  if (rc != PC_OK) return rc;
  size_t n = rows > cols ? rows : cols;
  double *c = malloc(n * n * sizeof *c);
  if (c == NULL) return PC_ENOMEM;

  if (left_packed != NULL) {
    cblas_dsyrk(CblasRowMajor, CblasUpper, CblasNoTrans, (int)rows, (int)cols, 1.0, g,
                (int)ld, 0.0, c, (int)rows);
    pc_pack_f64(rows, c, left_packed);
  }
  if (right_packed != NULL) {
    cblas_dsyrk(CblasRowMajor, CblasUpper, CblasTrans, (int)cols, (int)rows, 1.0, g,
                (int)ld, 0.0, c, (int)cols);
    pc_pack_f64(cols, c, right_packed);
  }
  free(c);
  return PC_OK;
}

/* ------------------------------------------------------------------------------------ */
/* Statistics                                                                             */

void pc_stat_update_f32(size_t count, float *s, const float *inc, float beta2) {
  if (s == NULL || inc == NULL) return;
  if (beta2 == 1.0f) {
    for (size_t i = 0; i < count; i++) s[i] += inc[i];
    return;
  }
  const float w = 1.0f - beta2;
  for (size_t i = 0; i < count; i++) s[i] = beta2 * s[i] + w * inc[i];
}

void pc_stat_update_f64(size_t count, double *s, const double *inc, double beta2) {
  if (s == NULL || inc == NULL) return;
  if (beta2 == 1.0) {
    for (size_t i = 0; i < count; i++) s[i] += inc[i];
    return;
  }
  const double w = 1.0 - beta2;
  for (size_t i = 0; i < count; i++) s[i] = beta2 * s[i] + w * inc[i];
}

/* ------------------------------------------------------------------------------------ */
/* Preconditioned direction                                                               */

/* p (stride ld) <- g (stride ld); p is g or apart from it (direction_check). */
static void copy_rows(size_t rows, size_t cols, const void *g, size_t ld, void *p, size_t sz) {
  if (g == p) return;
  for (size_t i = 0; i < rows; i++)
    memcpy((char *)p + i * ld * sz, (const char *)g + i * ld * sz, cols * sz);
}

int pc_direction_f32(size_t rows, size_t cols, const float *lroot, const float *g, size_t ld,
                     const float *rroot, float *p) {
  int rc = direction_check(rows, cols, lroot, g, ld, rroot, p, sizeof *p);
  if (rc != PC_OK) return rc;
  const int m = (int)rows, n = (int)cols, ldg = (int)ld;
  if (lroot == NULL && rroot == NULL) {
    copy_rows(rows, cols, g, ld, p, sizeof *p);
    return PC_OK;
  }
  /* gemm must not write what it reads: go through t unless exactly one product is taken
   * and p is apart from g (p is either g or apart from it, see direction_check). */
  int direct = (lroot == NULL || rroot == NULL) && p != g;
  float *t = NULL;
  if (!direct) {
    t = malloc(rows * cols * sizeof *t);
    if (t == NULL) return PC_ENOMEM;
  }

  if (lroot != NULL && rroot != NULL) {
    /* t = L g; p = t R */
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, m, n, m, 1.0f, lroot, m, g, ldg,
                0.0f, t, n);
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, m, n, n, 1.0f, t, n, rroot, n,
                0.0f, p, ldg);
  } else {
    float *out = direct ? p : t;
    const int ldo = direct ? ldg : n;
    if (lroot != NULL)
      cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, m, n, m, 1.0f, lroot, m, g, ldg,
                  0.0f, out, ldo);
    else
      cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, m, n, n, 1.0f, g, ldg, rroot, n,
                  0.0f, out, ldo);
    if (!direct)
      for (size_t i = 0; i < rows; i++) memcpy(p + i * ld, t + i * cols, cols * sizeof *p);
  }
  free(t);
  return PC_OK;
}

int pc_direction_f64(size_t rows, size_t cols, const double *lroot, const double *g, size_t ld,
                     const double *rroot, double *p) {
  int rc = direction_check(rows, cols, lroot, g, ld, rroot, p, sizeof *p);
  if (rc != PC_OK) return rc;
  const int m = (int)rows, n = (int)cols, ldg = (int)ld;
  if (lroot == NULL && rroot == NULL) {
    copy_rows(rows, cols, g, ld, p, sizeof *p);
    return PC_OK;
  }
  int direct = (lroot == NULL || rroot == NULL) && p != g;
  double *t = NULL;
  if (!direct) {
    t = malloc(rows * cols * sizeof *t);
    if (t == NULL) return PC_ENOMEM;
  }

  if (lroot != NULL && rroot != NULL) {
    cblas_dgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, m, n, m, 1.0, lroot, m, g, ldg,
                0.0, t, n);
    cblas_dgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, m, n, n, 1.0, t, n, rroot, n, 0.0,
                p, ldg);
  } else {
    double *out = direct ? p : t;
    const int ldo = direct ? ldg : n;
    if (lroot != NULL)
      cblas_dgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, m, n, m, 1.0, lroot, m, g, ldg,
                  0.0, out, ldo);
    else
      cblas_dgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, m, n, n, 1.0, g, ldg, rroot, n,
                  0.0, out, ldo);
    if (!direct)
      for (size_t i = 0; i < rows; i++) memcpy(p + i * ld, t + i * cols, cols * sizeof *p);
  }
  free(t);
  return PC_OK;
}
