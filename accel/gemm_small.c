/*
 * gemm_small.c -- the CPU backend's own single-precision product for small blocks: every
 * dimension in [AC__GEMM_SMALL_MIN, AC__GEMM_SMALL_MAX] (Shampoo's 128-blocks: L G_b, then
 * (L G_b) R, and the off-diagonal parts of the statistics' syrk), on AVX-512F.
 *
 * Why: OpenBLAS runs its Haswell (AVX2) kernels on this project's machines
 * (OPENBLAS_CORETYPE=Haswell, which the environment sets and we leave alone). At order 128
 * they reach ~100 GFLOP/s on one Zen 5 core, about the 256-bit peak; 512-bit FMAs double that
 * peak. Nothing here is faster than OpenBLAS on large products, which keep OpenBLAS.
 *
 * The kernel: C is cut into tiles of 8 rows x 32 columns, each held in 16 zmm accumulators
 * over the whole of k (no blocking in k: k <= 256, a tile's B panel is at most 32 KB, in L1).
 * A is read in place (a broadcast per row and k: contiguous along k without transpose, along
 * the rows with it); B in place when not transposed (two 16-float loads per k), else through a
 * 32-column panel transposed on the stack. Ragged edges: masked loads and stores for columns;
 * rows past m read the last row again and are not stored. Each C value is the sum over k in
 * order with one FMA per term, then alpha times it, plus beta C when beta is not 0 (C is not
 * read at beta 0, as BLAS): the same terms as a BLAS sum, rounded in a possibly different
 * order than OpenBLAS's kernels (tests/accel compares both with a double reference).
 *
 * The statistics' Gram matrices (ac__syrk_small_packed) run the same tiles over A and A^T,
 * only those that reach the diagonal or above it (at order 128, 40 of 64), and store
 * straight into the packed upper triangle: no dense scratch and no packing pass.
 */
#include "gemm_small.h"

#include <stdint.h>

#if defined(__GNUC__) && defined(__x86_64__)
#include <immintrin.h>

#define GS_TARGET __attribute__((target("avx512f")))
enum { GS_MR = 8, GS_NR = 32 };

/* Where a tile's rows go: dense rows of C (packed_n 0), or the packed upper triangle of a
 * symmetric C of order packed_n (syrk), only its elements on or above the diagonal. */
typedef struct {
  float *c;
  size_t ldc, packed_n;
  float alpha, beta;
} gs_out;

/* C[i][j0 + t] = alpha y[t] (+ beta C) for the lanes t of the 32-bit mask (y0: 0-15, y1:
 * 16-31); in packed mode only lanes with j0 + t >= i. */
GS_TARGET static inline void gs_store(const gs_out *o, size_t i, size_t j0, uint32_t mask,
                                      __m512 y0, __m512 y1) {
  float *cr = o->c + i * o->ldc + j0;
  if (o->packed_n > 0) {
    /* row i of the packed triangle starts at i n - i (i - 1) / 2 with column i, so column j
     * is at that start + j - i, which is >= 0 for every j0 here */
    if (i > j0) mask &= i - j0 >= 32 ? 0u : ~0u << (i - j0);
    if (mask == 0) return;
    cr = o->c + i * o->packed_n - i * (i - 1) / 2 - i + j0;
  }
  const __mmask16 m0 = (__mmask16)(mask & 0xFFFFu), m1 = (__mmask16)(mask >> 16);
  const __m512 va = _mm512_set1_ps(o->alpha);
  y0 = _mm512_mul_ps(va, y0);
  y1 = _mm512_mul_ps(va, y1);
  if (o->beta != 0.0f) {
    const __m512 vb = _mm512_set1_ps(o->beta);
    y0 = _mm512_fmadd_ps(vb, _mm512_maskz_loadu_ps(m0, cr), y0);
    y1 = _mm512_fmadd_ps(vb, _mm512_maskz_loadu_ps(m1, cr + 16), y1);
  }
  _mm512_mask_storeu_ps(cr, m0, y0);
  _mm512_mask_storeu_ps(cr + 16, m1, y1);
}

/* One row of a tile: the accumulators c<r>0, c<r>1 of row r (named registers: an array
 * indexed at run time in the stores would live on the stack). */
#define GS_FMA(r)                                   \
  do {                                              \
    const __m512 x = _mm512_set1_ps(a##r[p * aps]); \
    c##r##0 = _mm512_fmadd_ps(x, b0, c##r##0);      \
    c##r##1 = _mm512_fmadd_ps(x, b1, c##r##1);      \
  } while (0)
#define GS_STORE(r)                                              \
  do {                                                           \
    if (r < mr) gs_store(o, i0 + r, j0, mask, c##r##0, c##r##1); \
  } while (0)

/* One tile: rows i0 .. i0 + mr of C, columns j0 + [0, 32) of the mask, = alpha sum_p A(r, p)
 * B(p, j) (+ beta C). A(r, p) is a[r * ars + p * aps] (a: row i0); B(p, j) is b[p * bps + j]
 * (b: column j0). Rows past mr read row mr - 1 again and are not stored. */
GS_TARGET static void gs_tile(size_t k, const float *a, size_t ars, size_t aps, const float *b,
                              size_t bps, size_t mr, uint32_t mask, const gs_out *o, size_t i0,
                              size_t j0) {
  const float *a0 = a, *a1 = a + (mr > 1 ? 1 : mr - 1) * ars, *a2 = a + (mr > 2 ? 2 : mr - 1) * ars,
              *a3 = a + (mr > 3 ? 3 : mr - 1) * ars, *a4 = a + (mr > 4 ? 4 : mr - 1) * ars,
              *a5 = a + (mr > 5 ? 5 : mr - 1) * ars, *a6 = a + (mr > 6 ? 6 : mr - 1) * ars,
              *a7 = a + (mr > 7 ? 7 : mr - 1) * ars;
  const __mmask16 m0 = (__mmask16)(mask & 0xFFFFu), m1 = (__mmask16)(mask >> 16);
  __m512 c00 = _mm512_setzero_ps(), c01 = c00, c10 = c00, c11 = c00, c20 = c00, c21 = c00,
         c30 = c00, c31 = c00, c40 = c00, c41 = c00, c50 = c00, c51 = c00, c60 = c00, c61 = c00,
         c70 = c00, c71 = c00;
  for (size_t p = 0; p < k; p++) {
    const __m512 b0 = _mm512_maskz_loadu_ps(m0, b + p * bps);
    const __m512 b1 = _mm512_maskz_loadu_ps(m1, b + p * bps + 16);
    GS_FMA(0);
    GS_FMA(1);
    GS_FMA(2);
    GS_FMA(3);
    GS_FMA(4);
    GS_FMA(5);
    GS_FMA(6);
    GS_FMA(7);
  }
  GS_STORE(0);
  GS_STORE(1);
  GS_STORE(2);
  GS_STORE(3);
  GS_STORE(4);
  GS_STORE(5);
  GS_STORE(6);
  GS_STORE(7);
}

/* op(A) op(B) into o, by panels of 32 columns of B and tiles of 8 rows of A; in packed mode
 * only the tiles that reach the diagonal or above it. */
GS_TARGET static void gs_run(int ta, int tb, size_t m, size_t n, size_t k, const float *a,
                             size_t lda, const float *b, size_t ldb, const gs_out *o) {
  _Alignas(64) float panel[AC__GEMM_SMALL_MAX * GS_NR];
  const size_t ars = ta ? 1 : lda, aps = ta ? lda : 1;
  for (size_t j0 = 0; j0 < n; j0 += GS_NR) {
    const size_t nr = n - j0 < GS_NR ? n - j0 : GS_NR;
    const uint32_t mask = nr >= 32 ? 0xFFFFFFFFu : (1u << nr) - 1;
    const float *bp = b + j0;
    size_t bps = ldb;
    if (tb) {
      /* B(p, j0 + j) = b[(j0 + j) * ldb + p]: the panel row by row along k */
      for (size_t j = 0; j < nr; j++)
        for (size_t p = 0; p < k; p++) panel[p * GS_NR + j] = b[(j0 + j) * ldb + p];
      bp = panel;
      bps = GS_NR;
    }
    const size_t rows = o->packed_n > 0 && j0 + nr < m ? j0 + nr : m;
    for (size_t i0 = 0; i0 < rows; i0 += GS_MR) {
      const size_t mr = m - i0 < GS_MR ? m - i0 : GS_MR;
      gs_tile(k, a + i0 * ars, ars, aps, bp, bps, mr, mask, o, i0, j0);
    }
  }
}
#endif

static int gs_have_avx512(void) {
#if defined(__GNUC__) && defined(__x86_64__)
  /* The caller (the backend's ISA, chosen once) has checked the processor; this check keeps
   * the functions safe on their own (libgcc's cached flags: a few loads a call). */
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx512f");
#else
  return 0;
#endif
}

int ac__gemm_small_fits(size_t m, size_t n, size_t k) {
  const size_t lo = AC__GEMM_SMALL_MIN, hi = AC__GEMM_SMALL_MAX;
  return m >= lo && m <= hi && n >= lo && n <= hi && k >= lo && k <= hi &&
         m * n * k >= AC__GEMM_SMALL_MIN_MACS;
}

int ac__gemm_small(int ta, int tb, size_t m, size_t n, size_t k, float alpha, const float *a,
                   size_t lda, const float *b, size_t ldb, float beta, float *c, size_t ldc) {
  if (!ac__gemm_small_fits(m, n, k) || !gs_have_avx512()) return -1;
#if defined(__GNUC__) && defined(__x86_64__)
  const gs_out o = {c, ldc, 0, alpha, beta};
  gs_run(ta, tb, m, n, k, a, lda, b, ldb, &o);
  return 0;
#else
  (void)ta, (void)tb, (void)alpha, (void)a, (void)lda, (void)b, (void)ldb, (void)beta, (void)c;
  (void)ldc;
  return -1;
#endif
}

int ac__syrk_small_packed(int trans, size_t n, size_t k, float alpha, const float *a, size_t lda,
                          float beta, float *c_packed) {
  /* n is not bounded by the panel (k x 32 floats): a tile's work does not depend on it */
  const size_t lo = AC__GEMM_SMALL_MIN, hi = AC__GEMM_SMALL_MAX;
  if (n < lo || n > AC__SYRK_SMALL_MAX_N || k < lo || k > hi ||
      n * n * k < AC__GEMM_SMALL_MIN_MACS || !gs_have_avx512())
    return -1;
#if defined(__GNUC__) && defined(__x86_64__)
  /* G G^T: A(i, p) = a[i lda + p], B(p, j) = A(j, p), B transposed; G^T G: A(i, p) =
   * a[p lda + i], B(p, j) = a[p lda + j], B in place. */
  const gs_out o = {c_packed, 0, n, alpha, beta};
  gs_run(trans, !trans, n, n, k, a, lda, a, lda, &o);
  return 0;
#else
  (void)trans, (void)alpha, (void)a, (void)lda, (void)beta, (void)c_packed;
  return -1;
#endif
}
