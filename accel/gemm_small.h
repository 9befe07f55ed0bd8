/*
 * gemm_small.h -- the CPU backend's AVX-512F product for small blocks (gemm_small.c);
 * internal to accel: outside code must not include it.
 */
#ifndef PRECOND_AC_GEMM_SMALL_H
#define PRECOND_AC_GEMM_SMALL_H

#include <stddef.h>

/* The shapes it takes: every dimension in [MIN, MAX] and at least MIN_MACS multiply-adds.
 * MAX bounds the transposed-B panel on the stack (MAX x 32 floats); MIN and MIN_MACS keep the
 * models' own products (attention's 64 x 64 x 32 per head, a classifier's 10 columns) on
 * OpenBLAS, so that only the optimizers' blocks change kernel. */
enum { AC__GEMM_SMALL_MIN = 32, AC__GEMM_SMALL_MAX = 256, AC__GEMM_SMALL_MIN_MACS = 64 * 64 * 64 };

/* The Gram matrices' order may go past MAX (k may not: it bounds the panel): K-FAC's dense
 * factors of orders 384-513 from 256 rows (the Transformer's qkv, fc1 and fc2), where the
 * dense scratch, OpenBLAS's AVX2 products and the packing pass cost twice these tiles. */
enum { AC__SYRK_SMALL_MAX_N = 1024 };

/* 1 when ac__gemm_small takes an m x n x k product. */
int ac__gemm_small_fits(size_t m, size_t n, size_t k);

/* C = alpha op(A) op(B) + beta C, row-major, as cblas_sgemm with ta / tb nonzero for a
 * transposed A / B (beta 0: C is not read). Returns 0 when done, -1 when not taken (a shape
 * outside ac__gemm_small_fits, no AVX-512F on this processor or in this build): the caller
 * then calls BLAS. No allocation; no aliasing of C with A or B. */
int ac__gemm_small(int ta, int tb, size_t m, size_t n, size_t k, float alpha, const float *a,
                   size_t lda, const float *b, size_t ldb, float beta, float *c, size_t ldc);

/* The packed upper triangle C = alpha A A^T + beta C (trans 0, A n x k) or alpha A^T A + beta C
 * (trans 1, A k x n), as ac_syrk_packed, computed by ac__gemm_small's tiles and written
 * straight into c_packed (beta 0: not read). Returns 0 when done, -1 when not taken (k
 * outside [MIN, MAX], n outside [MIN, SYRK_MAX_N], under MIN_MACS, or no AVX-512F): the
 * caller then uses BLAS. */
int ac__syrk_small_packed(int trans, size_t n, size_t k, float alpha, const float *a, size_t lda,
                          float beta, float *c_packed);

#endif
