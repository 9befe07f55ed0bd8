/* test_symmetric.c -- packed layout, bf16 transport and finiteness checks. */
#include <float.h>
#include <math.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>

#include "preconditioner.h"

static float bits_to_f32(uint32_t u) {
  float f;
  memcpy(&f, &u, sizeof f);
  return f;
}

static void test_packed_len(void **state) {
  (void)state;
  assert_int_equal(pc_packed_len(0), 0);
  assert_int_equal(pc_packed_len(1), 1);
  assert_int_equal(pc_packed_len(3), 6);
  assert_int_equal(pc_packed_len(1024), 524800);
}

/* The layout is the upper triangle row by row. */
static void test_pack_layout(void **state) {
  (void)state;
  const float dense[9] = {1, 2, 3, /**/ -9, 4, 5, /**/ -9, -9, 6};
  float packed[6];
  pc_pack_f32(3, dense, packed);
  for (int i = 0; i < 6; i++) assert_true(packed[i] == (float)(i + 1));
  float back[9];
  pc_unpack_f32(3, packed, back);
  const float want[9] = {1, 2, 3, 2, 4, 5, 3, 5, 6};
  assert_memory_equal(back, want, sizeof want);
}

static void test_pack_round_trip(void **state) {
  (void)state;
  const size_t sizes[] = {1, 2, 7, 64, 129};
  for (size_t s = 0; s < sizeof sizes / sizeof *sizes; s++) {
    size_t n = sizes[s];
    double *a = malloc(n * n * sizeof *a), *b = malloc(n * n * sizeof *b);
    double *p = malloc(pc_packed_len(n) * sizeof *p);
    float *af = malloc(n * n * sizeof *af), *bf = malloc(n * n * sizeof *bf);
    float *pf = malloc(pc_packed_len(n) * sizeof *pf);
    assert_non_null(a);
    assert_non_null(b);
    assert_non_null(p);
    assert_non_null(af);
    assert_non_null(bf);
    assert_non_null(pf);
    for (size_t i = 0; i < n; i++)
      for (size_t j = i; j < n; j++) {
        a[i * n + j] = a[j * n + i] = (double)(i * 1000 + j) + 0.25;
        af[i * n + j] = af[j * n + i] = (float)a[i * n + j];
      }
    pc_pack_f64(n, a, p);
    pc_unpack_f64(n, p, b);
    assert_memory_equal(a, b, n * n * sizeof *a);
    pc_pack_f32(n, af, pf);
    pc_unpack_f32(n, pf, bf);
    assert_memory_equal(af, bf, n * n * sizeof *af);
    free(a);
    free(b);
    free(p);
    free(af);
    free(bf);
    free(pf);
  }
}

static void test_bf16_rounding(void **state) {
  (void)state;
  struct {
    uint32_t in;
    uint16_t out;
  } cases[] = {
      {0x3f800000u, 0x3f80}, /* 1.0 exact */
      {0x3f808000u, 0x3f80}, /* 1 + 2^-8: halfway, rounds to even (down) */
      {0x3f818000u, 0x3f82}, /* 1 + 3 * 2^-8: halfway, rounds to even (up) */
      {0x3f808001u, 0x3f81}, /* just above halfway: up */
      {0x3f807fffu, 0x3f80}, /* just below halfway: down */
      {0x80000000u, 0x8000}, /* -0 */
      {0x7f800000u, 0x7f80}, /* +Inf */
      {0xff800000u, 0xff80}, /* -Inf */
      {0x7f7fffffu, 0x7f80}, /* FLT_MAX rounds up to Inf */
      {0x00000001u, 0x0000}, /* tiny subnormal rounds to 0 */
  };
  for (size_t i = 0; i < sizeof cases / sizeof *cases; i++) {
    float f = bits_to_f32(cases[i].in);
    uint16_t h;
    pc_f32_to_bf16(1, &f, &h);
    assert_int_equal(h, cases[i].out);
  }
  /* NaNs stay NaN, including one whose payload sits only in the dropped bits. */
  const uint32_t nans[] = {0x7fc00000u, 0x7f800001u, 0xff800001u, 0x7fffffffu};
  for (size_t i = 0; i < sizeof nans / sizeof *nans; i++) {
    float f = bits_to_f32(nans[i]), g;
    uint16_t h;
    pc_f32_to_bf16(1, &f, &h);
    pc_bf16_to_f32(1, &h, &g);
    assert_true(isnan(g));
    assert_int_equal(h >> 15, nans[i] >> 31);
  }
}

/* Every bf16 pattern survives bf16 -> f32 -> bf16 exactly (NaNs stay NaN). */
static void test_bf16_round_trip(void **state) {
  (void)state;
  uint16_t *in = malloc(65536 * sizeof *in), *out = malloc(65536 * sizeof *out);
  float *f = malloc(65536 * sizeof *f);
  assert_non_null(in);
  assert_non_null(out);
  assert_non_null(f);
  for (uint32_t i = 0; i < 65536; i++) in[i] = (uint16_t)i;
  pc_bf16_to_f32(65536, in, f);
  pc_f32_to_bf16(65536, f, out);
  for (uint32_t i = 0; i < 65536; i++) {
    if (isnan(f[i]))
      assert_true((out[i] & 0x7f80) == 0x7f80 && (out[i] & 0x7f) != 0);
    else
      assert_int_equal(out[i], in[i]);
  }
  /* f32 -> bf16 -> f32 is within half a bf16 ulp (relative 2^-8) for normal values. */
  for (int i = 0; i < 1000; i++) {
    float x = (float)((i - 500) * 0.37 + 1e-3 * i * i), y;
    uint16_t h;
    pc_f32_to_bf16(1, &x, &h);
    pc_bf16_to_f32(1, &h, &y);
    assert_true(fabsf(x - y) <= fabsf(x) * (1.0f / 256.0f));
  }
  free(in);
  free(out);
  free(f);
}

/* pc_unpack_finite_f32 writes what pc_unpack_f32 writes (rows ld apart, the padding left
 * alone), across tile edges (16) and odd orders, and says whether every value was finite. */
static void test_unpack_finite(void **state) {
  (void)state;
  const size_t sizes[] = {1, 2, 7, 16, 17, 33, 129};
  const float bad[] = {NAN, INFINITY, -INFINITY, -NAN};
  for (size_t s = 0; s < sizeof sizes / sizeof *sizes; s++) {
    const size_t n = sizes[s], len = pc_packed_len(n);
    for (size_t pad = 0; pad <= 3; pad += 3) {
      const size_t ld = n + pad;
      float *p = malloc(len * sizeof *p), *want = malloc(n * n * sizeof *want);
      float *got = malloc(n * ld * sizeof *got);
      assert_non_null(p);
      assert_non_null(want);
      assert_non_null(got);
      for (size_t k = 0; k < len; k++) p[k] = (float)k * (k % 2 ? -0.5f : 0.25f);
      pc_unpack_f32(n, p, want);
      for (size_t k = 0; k < n * ld; k++) got[k] = -7.0f;
      assert_int_equal(pc_unpack_finite_f32(n, p, got, ld), 1);
      for (size_t i = 0; i < n; i++) {
        assert_memory_equal(got + i * ld, want + i * n, n * sizeof *got);
        for (size_t j = n; j < ld; j++) assert_true(got[i * ld + j] == -7.0f);
      }
      const size_t at[] = {0, len / 2, len - 1};
      for (size_t a = 0; a < sizeof at / sizeof *at; a++)
        for (size_t b = 0; b < sizeof bad / sizeof *bad; b++) {
          const float keep = p[at[a]];
          p[at[a]] = bad[b];
          assert_int_equal(pc_unpack_finite_f32(n, p, got, ld), 0);
          p[at[a]] = keep;
        }
      free(p);
      free(want);
      free(got);
    }
  }
}

static void test_finite(void **state) {
  (void)state;
  float f[5] = {0, 1, -2, 3e38f, 1e-40f};
  double d[5] = {0, 1, -2, 1e308, 5e-324};
  assert_true(pc_all_finite_f32(5, f));
  assert_true(pc_all_finite_f64(5, d));
  assert_true(pc_all_finite_f32(0, NULL));
  const float bad32[] = {NAN, INFINITY, -INFINITY};
  const double bad64[] = {NAN, INFINITY, -INFINITY};
  for (int b = 0; b < 3; b++)
    for (int pos = 0; pos < 5; pos++) {
      float g[5];
      double e[5];
      memcpy(g, f, sizeof g);
      memcpy(e, d, sizeof e);
      g[pos] = bad32[b];
      e[pos] = bad64[b];
      assert_false(pc_all_finite_f32(5, g));
      assert_false(pc_all_finite_f64(5, e));
    }
  /* The f32 check goes in blocks of 1024: a bad value on either side of a block's edge, and
   * in the last, short block; -FLT_MAX and negative NaNs too. */
  enum { N = 2500 };
  float *big = malloc(N * sizeof *big);
  assert_non_null(big);
  for (size_t i = 0; i < N; i++) big[i] = (i % 2 ? -FLT_MAX : FLT_MAX) / (float)(i + 1);
  assert_true(pc_all_finite_f32(N, big));
  const size_t at[] = {0, 1023, 1024, 2047, 2048, N - 1};
  for (size_t a = 0; a < sizeof at / sizeof *at; a++)
    for (int b = 0; b < 4; b++) {
      float keep = big[at[a]];
      big[at[a]] = b < 3 ? bad32[b] : -NAN;
      assert_false(pc_all_finite_f32(N, big));
      assert_true(pc_all_finite_f32(at[a], big)); /* the values before it are fine */
      big[at[a]] = keep;
    }
  free(big);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_packed_len),      cmocka_unit_test(test_pack_layout),
      cmocka_unit_test(test_pack_round_trip), cmocka_unit_test(test_bf16_rounding),
      cmocka_unit_test(test_bf16_round_trip), cmocka_unit_test(test_finite),
      cmocka_unit_test(test_unpack_finite),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
