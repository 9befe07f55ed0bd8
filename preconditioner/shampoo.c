/*
 * shampoo.c -- Shampoo's per-block statistics and preconditioned direction
 * (Gupta, Koren, Singer 2018; Anil et al. 2020, section 3):
 *
 *   L <- beta2 L + (1 - beta2) G G^T,   R <- beta2 R + (1 - beta2) G^T G,
 *   P  = L^(-1/4) G R^(-1/4).
 *
 * The roots come from roots.c (or the daemon); here they are plain dense matrices.
 * The kernels live in shampoo_impl.h, instantiated here for fp32 and fp64.
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

static int direction_check(size_t rows, size_t cols, const void *lroot, const void *g, size_t ld,
                           const void *rroot, const void *p, size_t sz) {
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
/* Helpers of the direction                                                               */

/* p (stride ld) <- g (stride ld); p is g or apart from it (direction_check). */
static void copy_rows(size_t rows, size_t cols, const void *g, size_t ld, void *p, size_t sz) {
  if (g == p) return;
  for (size_t i = 0; i < rows; i++)
    memcpy((char *)p + i * ld * sz, (const char *)g + i * ld * sz, cols * sz);
}

/* ------------------------------------------------------------------------------------ */
/* Gram matrices, statistics and the preconditioned direction, one instance per precision */

#define REAL      float
#define SFX(name) name##_f32
#define GEMM      cblas_sgemm
#define SYRK      cblas_ssyrk
#include "shampoo_impl.h"

#define REAL      double
#define SFX(name) name##_f64
#define GEMM      cblas_dgemm
#define SYRK      cblas_dsyrk
#include "shampoo_impl.h"
