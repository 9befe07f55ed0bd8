/*
 * conv_lanes.c -- the lanes layout's packing and copy-out (conv_lanes.h): 16 images go into
 * the 16 lanes of a vector and come back out, through 16 x 16 transposes in registers.
 *
 * Why: the tall layout (backend_cpu.c) computes a conv over positions of rows w + 1 wide
 * and images h + 1 tall, and throws column w and row h away: 15% more products than kept at
 * 14x14, 31% at 7x7. Here every position computed is kept; the price is this transpose on
 * the way in and out, small against the products at 32-64 channels (a packed float feeds
 * 9 oc multiply-adds).
 */
#include "conv_lanes.h"

size_t ac__lanes_chan_len(size_t h, size_t w) {
  return (h + 2) * (w + 2) * AC__LANES;
}

#if defined(__GNUC__) && defined(__x86_64__)
#include <immintrin.h>

#define LANES_TARGET __attribute__((target("avx512f")))

/* r[j][i] = r[i][j]: unpack pairs of rows, then shuffles of 4-float lanes. */
LANES_TARGET static inline void lanes_transpose(__m512 r[16]) {
  __m512 t[16], u[16];
  for (int k = 0; k < 8; k++) {
    t[2 * k] = _mm512_unpacklo_ps(r[2 * k], r[2 * k + 1]);
    t[2 * k + 1] = _mm512_unpackhi_ps(r[2 * k], r[2 * k + 1]);
  }
  /* u[4 m + c], lane L: rows 4 m .. 4 m + 3 of column 4 L + c */
  for (int m = 0; m < 4; m++) {
    u[4 * m] = _mm512_shuffle_ps(t[4 * m], t[4 * m + 2], _MM_SHUFFLE(1, 0, 1, 0));
    u[4 * m + 1] = _mm512_shuffle_ps(t[4 * m], t[4 * m + 2], _MM_SHUFFLE(3, 2, 3, 2));
    u[4 * m + 2] = _mm512_shuffle_ps(t[4 * m + 1], t[4 * m + 3], _MM_SHUFFLE(1, 0, 1, 0));
    u[4 * m + 3] = _mm512_shuffle_ps(t[4 * m + 1], t[4 * m + 3], _MM_SHUFFLE(3, 2, 3, 2));
  }
  /* column 4 L + c: lane L of u[c], u[4 + c], u[8 + c], u[12 + c] */
  for (int c = 0; c < 4; c++) {
    __m512 e1 = _mm512_shuffle_f32x4(u[c], u[4 + c], 0x88),
           e2 = _mm512_shuffle_f32x4(u[8 + c], u[12 + c], 0x88);
    __m512 o1 = _mm512_shuffle_f32x4(u[c], u[4 + c], 0xdd),
           o2 = _mm512_shuffle_f32x4(u[8 + c], u[12 + c], 0xdd);
    r[c] = _mm512_shuffle_f32x4(e1, e2, 0x88);
    r[8 + c] = _mm512_shuffle_f32x4(e1, e2, 0xdd);
    r[4 + c] = _mm512_shuffle_f32x4(o1, o2, 0x88);
    r[12 + c] = _mm512_shuffle_f32x4(o1, o2, 0xdd);
  }
}

LANES_TARGET void ac__lanes_pack(size_t h, size_t w, size_t nb, const float *src, size_t sstride,
                                 float *dst) {
  size_t n = h * w, y = 0, x = 0;
  for (size_t p0 = 0; p0 < n; p0 += AC__LANES) {
    size_t m = n - p0 < AC__LANES ? n - p0 : AC__LANES;
    __mmask16 k = (__mmask16)((1u << m) - 1u);
    __m512 r[16];
    for (size_t b = 0; b < AC__LANES; b++)
      r[b] = b < nb ? _mm512_maskz_loadu_ps(k, src + b * sstride + p0) : _mm512_setzero_ps();
    lanes_transpose(r);
    for (size_t i = 0; i < m; i++) { /* pixel p0 + i = (y, x) */
      _mm512_storeu_ps(dst + ((y + 1) * (w + 2) + x + 1) * AC__LANES, r[i]);
      if (++x == w) x = 0, y++;
    }
  }
}

LANES_TARGET void ac__lanes_unpack(size_t n, size_t nb, const float *src, float *dst,
                                   size_t dstride, const float *res) {
  for (size_t p0 = 0; p0 < n; p0 += AC__LANES) {
    size_t m = n - p0 < AC__LANES ? n - p0 : AC__LANES;
    __mmask16 k = (__mmask16)((1u << m) - 1u);
    __m512 r[16];
    for (size_t i = 0; i < AC__LANES; i++)
      r[i] = i < m ? _mm512_loadu_ps(src + (p0 + i) * AC__LANES) : _mm512_setzero_ps();
    lanes_transpose(r);
    for (size_t b = 0; b < nb; b++) {
      __m512 v = r[b];
      if (res != NULL) v = _mm512_add_ps(v, _mm512_maskz_loadu_ps(k, res + b * dstride + p0));
      _mm512_mask_storeu_ps(dst + b * dstride + p0, k, v);
    }
  }
}

/* Lanes 0-7 and 8-15 of v in double. */
LANES_TARGET static inline void lanes_to_double(__m512 v, __m512d *lo, __m512d *hi) {
  *lo = _mm512_cvtps_pd(_mm512_castps512_ps256(v));
  *hi = _mm512_cvtps_pd(_mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1)));
}

/* Position i's value goes into partial i mod 16 (p for the sum, r for the squares), each a
 * pair of 8-double vectors (lanes 0-7, 8-15), added in position order from 0; then the
 * partials are totalled pairwise as row_moments does, lane by lane. */
LANES_TARGET void ac__lanes_moments(size_t n, const float *src, double *s, double *q) {
  __m512d p[AC__LANES][2], r[AC__LANES][2];
  for (size_t j = 0; j < AC__LANES; j++)
    p[j][0] = p[j][1] = r[j][0] = r[j][1] = _mm512_setzero_pd();
  for (size_t i = 0; i < n; i++) {
    __m512d lo, hi;
    size_t j = i % AC__LANES;
    lanes_to_double(_mm512_loadu_ps(src + i * AC__LANES), &lo, &hi);
    p[j][0] = _mm512_add_pd(p[j][0], lo);
    p[j][1] = _mm512_add_pd(p[j][1], hi);
    r[j][0] = _mm512_fmadd_pd(lo, lo, r[j][0]);
    r[j][1] = _mm512_fmadd_pd(hi, hi, r[j][1]);
  }
  for (size_t w = AC__LANES / 2; w >= 1; w /= 2)
    for (size_t j = 0; j < w; j++)
      for (int h = 0; h < 2; h++) {
        p[j][h] = _mm512_add_pd(p[j][h], p[j + w][h]);
        r[j][h] = _mm512_add_pd(r[j][h], r[j + w][h]);
      }
  for (int h = 0; h < 2; h++) {
    _mm512_storeu_pd(s + 8 * h, _mm512_add_pd(_mm512_loadu_pd(s + 8 * h), p[0][h]));
    _mm512_storeu_pd(q + 8 * h, _mm512_add_pd(_mm512_loadu_pd(q + 8 * h), r[0][h]));
  }
}
#else
/* No AVX-512F kernels in this build: the backend never takes the lanes layout. */
void ac__lanes_pack(size_t h, size_t w, size_t nb, const float *src, size_t sstride, float *dst) {
  (void)h, (void)w, (void)nb, (void)src, (void)sstride, (void)dst;
}

void ac__lanes_unpack(size_t n, size_t nb, const float *src, float *dst, size_t dstride,
                      const float *res) {
  (void)n, (void)nb, (void)src, (void)dst, (void)dstride, (void)res;
}

void ac__lanes_moments(size_t n, const float *src, double *s, double *q) {
  (void)n, (void)src, (void)s, (void)q;
}
#endif
