/*
 * test_backend.c -- every ac_* primitive against naive reference loops written here (in
 * double where it matters), on the CPU backend and, when a CUDA device exists, on the CUDA
 * backend with the same inputs and the same references. Without a device the CUDA group is
 * skipped with a message.
 */
#include <math.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include <cmocka.h>

#include <cblas.h> /* openblas_get_num_threads: the CPU backend's thread count */

#include "accel.h"
#include "test_util.h"

/* ------------------------------------------------------------------------------------ */
/* Helpers                                                                                 */

static uint64_t rng_state = 88172645463325252ull;

static float frand(void) {
  return xorshift_frand(&rng_state);
}

static float *host_rand(size_t n) {
  float *x = malloc((n ? n : 1) * sizeof *x);
  assert_non_null(x);
  for (size_t i = 0; i < n; i++) x[i] = frand();
  return x;
}

static float *host_zeros(size_t n) {
  return xcalloc(n, sizeof(float));
}

static void *dev_alloc(ac_backend *be, size_t bytes) {
  void *p = NULL;
  OK(ac_malloc(be, bytes, &p));
  return p;
}

static float *dev_up(ac_backend *be, const float *h, size_t n) {
  float *d = dev_alloc(be, n * sizeof *d);
  OK(ac_memcpy_h2d(be, d, h, n * sizeof *d));
  return d;
}

static int32_t *dev_up_i32(ac_backend *be, const int32_t *h, size_t n) {
  int32_t *d = dev_alloc(be, n * sizeof *d);
  OK(ac_memcpy_h2d(be, d, h, n * sizeof *d));
  return d;
}

static float *dev_down(ac_backend *be, const float *d, size_t n) {
  float *h = host_zeros(n);
  OK(ac_memcpy_d2h(be, h, d, n * sizeof *h));
  return h;
}

/* A test's clean-up in one line: host buffers (host_rand's, dev_down's) and a backend's
 * (dev_up's, dev_alloc's). */
static void host_free_all(size_t n, float *const *p) {
  for (size_t i = 0; i < n; i++) free(p[i]);
}
static void dev_free_all(ac_backend *be, size_t n, float *const *p) {
  for (size_t i = 0; i < n; i++) ac_free(be, p[i]);
}
#define HOST_FREE(...) \
  host_free_all(sizeof((float *[]){__VA_ARGS__}) / sizeof(float *), (float *[]){__VA_ARGS__})
#define DEV_FREE(be, ...) \
  dev_free_all(be, sizeof((float *[]){__VA_ARGS__}) / sizeof(float *), (float *[]){__VA_ARGS__})

/* A conv or pooling geometry in one line: input (n, c, h, w), kernel kh x kw, strides,
 * padding, in ac_conv2d_geom's order (the formatter spreads a designated initializer over
 * ten lines, which made every test's setup a block of them). */
static ac_conv2d_geom geom(size_t n, size_t c, size_t h, size_t w, size_t kh, size_t kw,
                           size_t stride_h, size_t stride_w, size_t pad_h, size_t pad_w) {
  return (ac_conv2d_geom){.n = n,
                          .c = c,
                          .h = h,
                          .w = w,
                          .kh = kh,
                          .kw = kw,
                          .stride_h = stride_h,
                          .stride_w = stride_w,
                          .pad_h = pad_h,
                          .pad_w = pad_w};
}

/* got[i] within atol + rtol |want[i]|; reports the first miss. */
static void expect_close(const char *what, const float *got, const double *want, size_t n,
                         double atol, double rtol) {
  for (size_t i = 0; i < n; i++) {
    double err = fabs((double)got[i] - want[i]);
    if (!(err <= atol + rtol * fabs(want[i]))) {
      print_error("%s: element %zu is %.9g, expected %.9g\n", what, i, (double)got[i], want[i]);
      fail();
    }
  }
}

static double *dzeros(size_t n) {
  return xcalloc(n, sizeof(double));
}

/* ------------------------------------------------------------------------------------ */
/* Backend lifecycle and errors                                                            */

/* A CPU backend with 2 threads: OpenBLAS is left on one thread (the products run on the
 * backend's pool); large and small products, batched, match a direct double loop. */
static void test_cpu_threads(void **state) {
  (void)state;
  ac_backend_opts opts;
  ac_backend_opts_default(&opts);
  opts.threads = 2;
  ac_backend *be = NULL;
  OK(ac_backend_create(&be, &opts));
  const size_t sizes[][3] = {{5, 7, 3}, {160, 170, 180}}; /* below / above the threshold */
  for (size_t t = 0; t < 2; t++) {
    size_t m = sizes[t][0], n = sizes[t][1], k = sizes[t][2], batch = 3;
    float *ha = host_rand(batch * m * k), *hb = host_rand(k * n);
    double *want = dzeros(batch * m * n);
    for (size_t i = 0; i < batch; i++)
      for (size_t r = 0; r < m; r++)
        for (size_t j = 0; j < n; j++) {
          double acc = 0;
          for (size_t p = 0; p < k; p++) acc += (double)ha[(i * m + r) * k + p] * hb[p * n + j];
          want[(i * m + r) * n + j] = acc;
        }
    float *a = dev_up(be, ha, batch * m * k), *b = dev_up(be, hb, k * n);
    float *c = dev_alloc(be, batch * m * n * sizeof(float));
    OK(ac_sgemm_batched(be, AC_NO_TRANS, AC_NO_TRANS, m, n, k, 1.0f, a, k, m * k, b, n, 0, 0.0f, c,
                        n, m * n, batch));
    float *got = dev_down(be, c, batch * m * n);
    expect_close("sgemm on 2 threads", got, want, batch * m * n, 1e-4, 1e-5);
    assert_non_null(strstr(ac_backend_describe(be), "2 threads"));
    assert_int_equal(openblas_get_num_threads(), 1); /* the pool threads, not OpenBLAS */
    free(got);
    free(want);
    free(ha);
    free(hb);
    ac_free(be, a);
    ac_free(be, b);
    ac_free(be, c);
  }
  ac_backend_destroy(be);
}

/* be[0] on 1 thread and be[1] on 2, for the bit-for-bit comparisons, with the direct
 * kernels' ISA capped at isa (an ac_cpu_isa). */
static void cpu_pair_isa(ac_backend *be[2], int isa) {
  ac_backend_opts opts;
  ac_backend_opts_default(&opts);
  opts.cpu_isa = isa;
  for (int t = 0; t < 2; t++) {
    opts.threads = t + 1;
    OK(ac_backend_create(&be[t], &opts));
  }
}

static void cpu_pair(ac_backend *be[2]) {
  cpu_pair_isa(be, AC_CPU_ISA_BEST);
}

/* The direct-conv variants the tests run one by one: every ISA cap but BEST. A cap the
 * processor lacks falls back to the next (the backend's description names the variant). */
static const int conv_isas[] = {AC_CPU_ISA_PORTABLE, AC_CPU_ISA_AVX2, AC_CPU_ISA_AVX512};

/* The CPU backend's worker pool splits im2col, col2im, batch norm's passes and the gemms
 * (by blocks of columns and batch items) across its threads: on 2 threads every result
 * must be bit-identical to 1 thread (the tests of training check bit-exact reruns, and
 * results must not depend on the machine's cores). Sizes above the pool's thresholds, so
 * that the work really is split; the gemms cut by columns (a count that is not a multiple of
 * the block, B transposed, a strided batch) and by rows (A transposed). */
static void test_cpu_pool_bitwise(void **state) {
  (void)state;
  ac_backend *be[2] = {NULL, NULL};
  cpu_pair(be);
  const ac_conv2d_geom g = geom(6, 8, 20, 20, 3, 3, 1, 1, 1, 1);
  const size_t nx = 6 * 8 * 400, ncol = 8 * 9 * 6 * 400, c = 8, hw = 400;
  float *hx = host_rand(nx), *hdy = host_rand(nx), *hp = host_rand(5 * c);
  float *out[2] = {NULL, NULL};
  const size_t ng = 16 * 2400 + 16 * 72 + 6 * 8 * 400 + 2400 * 16;
  const size_t nout = 2 * ncol + 5 * nx + 4 * c + ng;
  for (int t = 0; t < 2; t++) {
    ac_backend *b = be[t];
    float *x = dev_up(b, hx, nx), *dy = dev_up(b, hdy, nx), *p = dev_up(b, hp, 5 * c);
    float *col = dev_alloc(b, ncol * sizeof(float)), *r = dev_alloc(b, nout * sizeof(float));
    OK(ac_im2col(b, &g, x, r + ncol));
    OK(ac_col2im(b, &g, r + ncol, r + 2 * ncol + 4 * nx));
    OK(ac_im2col_batch(b, &g, x, col));
    OK(ac_memcpy_d2d(b, r, col, ncol * sizeof(float)));
    float *rx = r + 2 * ncol, *st = r + 2 * ncol + 5 * nx;
    OK(ac_col2im_batch(b, &g, col, rx));
    OK(ac_channel_moments(b, g.n, c, hw, x, st, st + c));
    OK(ac_channel_affine(b, g.n, c, hw, x, p, p + c, dy, 1, rx + nx));
    OK(ac_channel_grad_sums(b, g.n, c, hw, dy, rx + nx, x, p + 2 * c, rx + 2 * nx, st + 2 * c,
                            st + 3 * c));
    OK(ac_channel_combine(b, g.n, c, hw, dy, rx + nx, x, p + 3 * c, p + 4 * c, p, rx + 3 * nx));
    float *gm = st + 4 * c; /* W (16 x 72) from dy; the batch-column matrix (72 x 2400) */
    OK(ac_sgemm(b, AC_NO_TRANS, AC_NO_TRANS, 16, 2400, 72, 1.0f, dy, 72, col, 2400, 0.0f, gm,
                2400));
    OK(ac_sgemm(b, AC_NO_TRANS, AC_TRANS, 16, 72, 2400, 0.5f, gm, 2400, col, 2400, 0.0f,
                gm + 16 * 2400, 72));
    OK(ac_sgemm_batched(b, AC_NO_TRANS, AC_NO_TRANS, 8, 400, 72, 1.0f, dy, 72, 0, r + ncol, 400,
                        72 * 400, 0.0f, gm + 16 * 2400 + 16 * 72, 400, 8 * 400, 6));
    OK(ac_sgemm(b, AC_TRANS, AC_TRANS, 2400, 16, 72, 1.0f, col, 2400, dy, 72, 0.0f,
                gm + 16 * 2400 + 16 * 72 + 6 * 8 * 400, 16)); /* m > n: cut by rows */
    out[t] = dev_down(b, r, nout);
    ac_free(b, x);
    ac_free(b, dy);
    ac_free(b, p);
    ac_free(b, col);
    ac_free(b, r);
  }
  assert_memory_equal(out[0], out[1], nout * sizeof(float));
  free(out[0]);
  free(out[1]);
  free(hx);
  free(hdy);
  free(hp);
  ac_backend_destroy(be[0]);
  ac_backend_destroy(be[1]);
}

/* Batch norm's sums (moments, masked gradient sums) run their whole 16-float blocks on
 * AVX2 or AVX-512F where the backend's variant has it: every variant must give the bits of
 * the portable loop (the same sums in the same order), on 1 and 2 threads, for rows that
 * are shorter than a block, not a multiple of it, and long; g written to gout with and
 * without a mask, and in place over dy. */
static void test_cpu_channel_sums_isa(void **state) {
  (void)state;
  const size_t shapes[][3] = {{3, 5, 7}, {4, 6, 49}, {2, 3, 1100}};
  for (size_t si = 0; si < sizeof shapes / sizeof shapes[0]; si++) {
    size_t outer = shapes[si][0], mid = shapes[si][1], inner = shapes[si][2];
    size_t n = outer * mid * inner, nout = 3 * n + 8 * mid;
    float *hx = host_rand(n), *hdy = host_rand(n), *hmask = host_rand(n), *hc = host_rand(mid);
    for (size_t i = 0; i < n; i++) hx[i] = 3.0f * hx[i] + 5.0f;
    float *ref = NULL;
    for (size_t v = 0; v < sizeof conv_isas / sizeof conv_isas[0]; v++) {
      ac_backend *be[2] = {NULL, NULL};
      cpu_pair_isa(be, conv_isas[v]);
      for (int t = 0; t < 2; t++) {
        ac_backend *b = be[t];
        float *x = dev_up(b, hx, n), *dy = dev_up(b, hdy, n), *mask = dev_up(b, hmask, n);
        float *c = dev_up(b, hc, mid), *r = dev_alloc(b, nout * sizeof(float));
        float *st = r + 3 * n;
        OK(ac_channel_moments(b, outer, mid, inner, x, st, st + mid));
        OK(ac_channel_grad_sums(b, outer, mid, inner, dy, mask, x, c, r, st + 2 * mid,
                                st + 3 * mid));
        OK(ac_channel_grad_sums(b, outer, mid, inner, dy, NULL, x, c, r + n, st + 4 * mid,
                                st + 5 * mid));
        OK(ac_memcpy_d2d(b, r + 2 * n, dy, n * sizeof(float)));
        OK(ac_channel_grad_sums(b, outer, mid, inner, r + 2 * n, mask, x, c, r + 2 * n,
                                st + 6 * mid, st + 7 * mid)); /* gout == dy */
        float *got = dev_down(b, r, nout);
        if (ref == NULL)
          ref = got;
        else {
          assert_memory_equal(ref, got, nout * sizeof(float));
          free(got);
        }
        ac_free(b, x);
        ac_free(b, dy);
        ac_free(b, mask);
        ac_free(b, c);
        ac_free(b, r);
      }
      ac_backend_destroy(be[0]);
      ac_backend_destroy(be[1]);
    }
    for (size_t m = 0; m < mid; m++) { /* and the sums are the sums (the plain one) */
      double s = 0;
      for (size_t o = 0; o < outer; o++)
        for (size_t i = 0; i < inner; i++) s += hdy[(o * mid + m) * inner + i];
      assert_true(fabs(ref[3 * n + 4 * mid + m] - s) <= 1e-5 * (1.0 + fabs(s)));
    }
    free(ref);
    free(hx);
    free(hdy);
    free(hmask);
    free(hc);
  }
}

/* The elementwise primitives, broadcasts and row reductions run on the pool too (blocks of
 * floats, rows): on 2 threads the same bits as on 1 and as the plain loop here, with a count
 * that is not a multiple of the pool's block, in place (out == x) as accel.h allows, and
 * once after the workers have gone to sleep (the hand-off's wake-up path). */
static void test_cpu_pool_elementwise(void **state) {
  (void)state;
  ac_backend *be[2] = {NULL, NULL};
  cpu_pair(be);
  const size_t n = 3 * 4096 * 5 + 77, rows = 61, hw = n / rows; /* rows x hw <= n */
  float *hx = host_rand(n), *hy = host_rand(n), *hv = host_rand(rows);
  float *want = host_zeros(8 * n);
  for (size_t i = 0; i < n; i++) {
    want[i] = 0.25f;
    want[n + i] = hx[i] * hy[i];
    want[2 * n + i] = 1.5f * hx[i] + -0.5f * hy[i];
    want[3 * n + i] = 2.0f * hx[i] + 3.0f;
    want[4 * n + i] = hx[i] > 0.0f ? hx[i] : 0.0f;
    want[5 * n + i] = hx[i] > 0.0f ? hy[i] : 0.0f;
    want[6 * n + i] = i < rows * hw ? hx[i] - hv[i / hw % rows] : 0.0f;
  }
  for (size_t m = 0; m < rows; m++) {
    double acc = 0.0;
    for (size_t i = 0; i < hw; i++) acc += hx[m * hw + i];
    want[7 * n + m] = (float)acc;
  }
  float *out[2] = {NULL, NULL};
  for (int t = 0; t < 2; t++) {
    ac_backend *b = be[t];
    float *x = dev_up(b, hx, n), *y = dev_up(b, hy, n), *v = dev_up(b, hv, rows);
    float *r = dev_alloc(b, 8 * n * sizeof(float));
    OK(ac_fill_f32(b, 8 * n, r, 0.0f));
    OK(ac_fill_f32(b, n, r, 0.25f));
    OK(ac_binary(b, AC_BIN_MUL, n, x, y, r + n));
    OK(ac_memcpy_d2d(b, r + 2 * n, x, n * sizeof(float)));
    OK(ac_axpby(b, n, 1.5f, r + 2 * n, -0.5f, y, r + 2 * n)); /* in place */
    OK(ac_affine(b, n, 2.0f, x, 3.0f, r + 3 * n));
    OK(ac_unary(b, AC_UNARY_RELU, n, x, r + 4 * n));
    OK(ac_unary_backward(b, AC_UNARY_RELU, n, x, y, r + 5 * n));
    OK(ac_bcast(b, AC_BIN_SUB, 1, rows, hw, x, v, r + 6 * n));
    /* Past the pool's longest spin: the workers sleep now, and the next call wakes them. */
    nanosleep(&(struct timespec){0, 2000000}, NULL);
    OK(ac_reduce(b, AC_REDUCE_SUM, 1, rows, hw, 1.0f, x, 0.0f, r + 7 * n));
    out[t] = dev_down(b, r, 8 * n);
    ac_free(b, x);
    ac_free(b, y);
    ac_free(b, v);
    ac_free(b, r);
  }
  assert_memory_equal(out[0], out[1], 8 * n * sizeof(float));
  assert_memory_equal(out[0], want, 7 * n * sizeof(float));
  for (size_t m = 0; m < rows; m++) assert_true(out[0][7 * n + m] == want[7 * n + m]);
  free(out[0]);
  free(out[1]);
  free(want);
  free(hx);
  free(hy);
  free(hv);
  ac_backend_destroy(be[0]);
  ac_backend_destroy(be[1]);
}

static void test_strerror_and_create(void **state) {
  (void)state;
  const int codes[] = {AC_OK,      AC_EINVAL,  AC_ENOMEM,    AC_ENODEV,
                       AC_ENOTSUP, AC_EDEVICE, AC_EMISMATCH, 12345};
  for (size_t i = 0; i < sizeof codes / sizeof codes[0]; i++) {
    assert_non_null(ac_strerror(codes[i]));
    assert_true(strlen(ac_strerror(codes[i])) > 0);
  }
  assert_string_equal(ac_strerror(AC_EINVAL), "invalid argument");

  ac_backend_opts opts;
  ac_backend_opts_default(&opts);
  assert_int_equal(opts.kind, AC_BACKEND_CPU);
  assert_int_equal(opts.threads, 1);

  ac_backend *be = (ac_backend *)0x1;
  assert_int_equal(ac_backend_create(NULL, &opts), AC_EINVAL);
  opts.kind = (ac_backend_kind)7;
  assert_int_equal(ac_backend_create(&be, &opts), AC_EINVAL);
  assert_null(be);
  assert_non_null(strstr(ac_backend_describe(NULL), "unknown backend kind"));
  opts.kind = AC_BACKEND_CPU;
  opts.threads = -1;
  assert_int_equal(ac_backend_create(&be, &opts), AC_EINVAL);
  opts.threads = 1;
  opts.cpu_isa = AC_CPU_ISA_AVX512 + 1;
  assert_int_equal(ac_backend_create(&be, &opts), AC_EINVAL);
  opts.cpu_isa = -1;
  assert_int_equal(ac_backend_create(&be, &opts), AC_EINVAL);
  opts.cpu_isa = AC_CPU_ISA_BEST;

  OK(ac_backend_create(&be, NULL));
  assert_non_null(be);
  assert_int_equal(ac_backend_kind_of(be), AC_BACKEND_CPU);
  assert_string_equal(ac_backend_name(be), "cpu");
  assert_non_null(strstr(ac_backend_describe(be), "OpenBLAS"));
  OK(ac_sync(be));
  ac_backend_destroy(be);
  ac_backend_destroy(NULL);

  /* CUDA: compiled out (ENOTSUP), no device (ENODEV), or a device. Never a crash. */
  opts.kind = AC_BACKEND_CUDA;
  opts.threads = 1;
  int rc = ac_backend_create(&be, &opts);
  assert_true(rc == AC_OK || rc == AC_ENOTSUP || rc == AC_ENODEV);
  if (rc == AC_OK) {
    assert_string_equal(ac_backend_name(be), "cuda");
    ac_backend_destroy(be);
  } else {
    assert_null(be);
    assert_true(strlen(ac_backend_describe(NULL)) > 0);
  }
}

static void test_invalid_arguments(void **state) {
  ac_backend *be = backend(state);
  float *d = dev_alloc(be, 64 * sizeof(float));
  int32_t *di = dev_alloc(be, 64 * sizeof(int32_t));
  void *p = (void *)0x1;

  assert_int_equal(ac_malloc(NULL, 16, &p), AC_EINVAL);
  assert_int_equal(ac_malloc(be, 16, NULL), AC_EINVAL);
  OK(ac_malloc(be, 0, &p));
  assert_null(p);
  assert_int_equal(ac_memcpy_h2d(be, NULL, d, 4), AC_EINVAL);
  assert_int_equal(ac_fill_f32(be, 4, NULL, 1.0f), AC_EINVAL);
  assert_int_equal(ac_fill_f32(NULL, 4, d, 1.0f), AC_EINVAL);
  assert_int_equal(ac_copy2d(be, 2, 4, d, 3, d + 32, 4), AC_EINVAL); /* lds < cols */
  assert_int_equal(ac_sgemm(be, AC_NO_TRANS, AC_NO_TRANS, 2, 2, 2, 1, d, 1, d, 2, 0, d + 8, 2),
                   AC_EINVAL); /* lda < k */
  assert_int_equal(ac_sgemm(be, (ac_trans)5, AC_NO_TRANS, 2, 2, 2, 1, d, 2, d, 2, 0, d + 8, 2),
                   AC_EINVAL);
  assert_int_equal(ac_sgemm(be, AC_NO_TRANS, AC_NO_TRANS, 2, 2, 2, 1, NULL, 2, d, 2, 0, d + 8, 2),
                   AC_EINVAL);
  /* Overlapping C blocks in a batch are refused. */
  assert_int_equal(ac_sgemm_batched(be, AC_NO_TRANS, AC_NO_TRANS, 2, 2, 2, 1, d, 2, 4, d + 8, 2, 4,
                                    0, d + 16, 2, 0, 3),
                   AC_EINVAL);
  assert_int_equal(ac_syrk_packed(be, AC_NO_TRANS, 4, 3, 1, d, 2, 0, d + 32), AC_EINVAL);
  assert_int_equal(ac_syrk_packed(be, AC_NO_TRANS, 4, 3, 1, d, 3, 0, NULL), AC_EINVAL);
  assert_int_equal(ac_unpack_sym(be, 4, d, d + 16, 3), AC_EINVAL);
  assert_int_equal(ac_binary(be, (ac_binary_op)9, 4, d, d, d), AC_EINVAL);
  assert_int_equal(ac_unary(be, AC_UNARY_COUNT, 4, d, d), AC_EINVAL);
  assert_int_equal(ac_unary(be, (ac_unary_op)-1, 4, d, d), AC_EINVAL);
  assert_string_equal(ac_unary_name(AC_UNARY_COUNT), "?");
  assert_int_equal(ac_axpby(be, 4, 1, d, 1, NULL, d), AC_EINVAL);
  assert_int_equal(ac_reduce(be, (ac_reduce_op)8, 1, 4, 1, 1, d, 0, d + 8), AC_EINVAL);
  assert_int_equal(ac_reduce(be, AC_REDUCE_SUM, 1, 4, 1, 1, d, 0, d), AC_EINVAL); /* alias */
  assert_int_equal(ac_reduce(be, AC_REDUCE_SUM, SIZE_MAX, 4, 4, 1, d, 0, d + 8), AC_EINVAL);
  assert_int_equal(ac_sum_to_host(be, 4, d, NULL), AC_EINVAL);
  assert_int_equal(ac_argmax_rows(be, 2, 0, d, di), AC_EINVAL);
  assert_int_equal(ac_xent_forward(be, 2, 0, d, di, d, d + 8), AC_EINVAL);

  size_t shape[3] = {2, 3, 4};
  int bad_perm[3] = {0, 0, 2}, perm[3] = {2, 1, 0};
  assert_int_equal(ac_permute(be, 3, shape, bad_perm, d, d + 32), AC_EINVAL);
  assert_int_equal(ac_permute(be, 0, shape, perm, d, d + 32), AC_EINVAL);
  assert_int_equal(ac_permute(be, 3, shape, perm, d, d), AC_EINVAL);

  ac_conv2d_geom g = geom(1, 1, 4, 4, 3, 3, 1, 1, 1, 1);
  size_t oh = 0, ow = 0;
  OK(ac_conv2d_out_hw(&g, &oh, &ow));
  assert_int_equal(oh, 4);
  assert_int_equal(ow, 4);
  g.stride_h = 0;
  assert_int_equal(ac_conv2d_out_hw(&g, &oh, &ow), AC_EINVAL);
  assert_int_equal(ac_im2col(be, &g, d, d + 16), AC_EINVAL);
  assert_int_equal(ac_channel_moments(be, 2, 2, 2, NULL, d, d + 4), AC_EINVAL);
  assert_int_equal(ac_channel_moments(be, 2, 2, 2, d, d + 8, d + 8), AC_EINVAL);
  assert_int_equal(ac_channel_affine(be, 2, 2, 2, d, NULL, d, NULL, 0, d + 8), AC_EINVAL);
  assert_int_equal(ac_channel_grad_sums(be, 2, 2, 2, d, NULL, d, d, NULL, d + 8, d + 8), AC_EINVAL);
  assert_int_equal(ac_channel_combine(be, 2, 2, 2, d, NULL, d, NULL, NULL, NULL, d + 8), AC_EINVAL);
  g.stride_h = 1;
  g.pad_w = 3; /* pad >= kernel */
  assert_int_equal(ac_pool2d_forward(be, AC_POOL_MAX, &g, d, d + 16, di), AC_EINVAL);
  g.pad_w = 0;
  g.kw = 9; /* kernel wider than the padded input */
  assert_int_equal(ac_conv2d_out_hw(&g, &oh, &ow), AC_EINVAL);
  assert_int_equal(ac_conv2d_out_hw(NULL, &oh, &ow), AC_EINVAL);
  g.kw = 3;
  assert_int_equal(ac_pool2d_backward(be, AC_POOL_MAX, &g, d, NULL, d + 16), AC_EINVAL);
  assert_int_equal(ac_pool2d_forward(be, (ac_pool_op)4, &g, d, d + 16, di), AC_EINVAL);

  assert_int_equal(ac_dropout_mask(be, 1, 0, 4, 1.0f, d), AC_EINVAL);
  assert_int_equal(ac_dropout_mask(be, 1, 0, 4, -0.1f, d), AC_EINVAL);
  assert_int_equal(ac_rand_normal(be, 1, 0, 4, 0.0f, -1.0f, d), AC_EINVAL);
  assert_int_equal(ac_rand_uniform(be, 1, 0, 4, NAN, 1.0f, d), AC_EINVAL);

  ac_adamw_args args = {
      .lr = 1e-3f, .beta1 = 0.9f, .beta2 = 0.999f, .eps = 1e-8f, .weight_decay = 0.0f, .step = 0};
  assert_int_equal(ac_adamw_update(be, 4, d, d + 8, d + 16, d + 24, &args), AC_EINVAL);
  args.step = 1;
  args.beta1 = 1.0f;
  assert_int_equal(ac_adamw_update(be, 4, d, d + 8, d + 16, d + 24, &args), AC_EINVAL);
  args.beta1 = 0.9f;
  assert_int_equal(ac_adamw_update(be, 4, d, d, d + 16, d + 24, &args), AC_EINVAL);
  assert_int_equal(ac_adamw_update(be, 4, d, d + 8, d + 16, d + 24, NULL), AC_EINVAL);
  ac_moment_graft_args mg = {0.1f, 0.9f, 0.0f, 1.0f, 0.01f, 0.99f, 1.0f, 1e-8f};
  assert_int_equal(ac_moment_graft(be, 4, d, d + 8, d + 16, d + 8, d + 24, &mg), AC_EINVAL);
  assert_int_equal(ac_moment_graft(be, 4, d, d + 8, d + 16, d + 24, d + 32, NULL), AC_EINVAL);
  mg.eps = 0.0f;
  assert_int_equal(ac_moment_graft(be, 4, d, d + 8, d + 16, d + 24, d + 32, &mg), AC_EINVAL);
  mg.eps = 1e-8f;
  mg.x_f = INFINITY;
  assert_int_equal(ac_moment_graft(be, 4, d, d + 8, d + 16, d + 24, d + 32, &mg), AC_EINVAL);

  /* Zero sizes are valid and touch nothing. */
  OK(ac_binary(be, AC_BIN_ADD, 0, NULL, NULL, NULL));
  OK(ac_sgemm(be, AC_NO_TRANS, AC_NO_TRANS, 0, 3, 3, 1, NULL, 3, NULL, 3, 0, NULL, 3));
  double s = -1.0;
  OK(ac_sum_to_host(be, 0, NULL, &s));
  assert_true(s == 0.0);

  ac_free(be, d);
  ac_free(be, di);
  ac_free(be, NULL);
}

/* ------------------------------------------------------------------------------------ */
/* Memory                                                                                  */

static void test_memory(void **state) {
  ac_backend *be = backend(state);
  const size_t n = 1000;
  float *h = host_rand(n);
  float *a = dev_up(be, h, n);
  float *b = dev_alloc(be, n * sizeof *b);
  assert_int_equal((uintptr_t)a % 256, 0);

  OK(ac_memcpy_d2d(be, b, a, n * sizeof *b));
  float *back = dev_down(be, b, n);
  assert_memory_equal(back, h, n * sizeof *h);
  free(back);

  OK(ac_fill_f32(be, n - 1, b + 1, 2.5f));
  back = dev_down(be, b, n);
  assert_true(back[0] == h[0]);
  for (size_t i = 1; i < n; i++) assert_true(back[i] == 2.5f);
  free(back);

  int32_t *di = dev_alloc(be, 10 * sizeof *di), hi[10];
  OK(ac_fill_i32(be, 10, di, -7));
  OK(ac_memcpy_d2h(be, hi, di, sizeof hi));
  for (int i = 0; i < 10; i++) assert_int_equal(hi[i], -7);

  /* copy2d: a 3 x 5 block out of a 10 x 20 matrix at (2, 4), into a 3 x 5 (ld 7) buffer. */
  float *big = dev_up(be, h, 200);
  float *blk = dev_alloc(be, 21 * sizeof *blk);
  OK(ac_fill_f32(be, 21, blk, -1.0f));
  OK(ac_copy2d(be, 3, 5, big + 2 * 20 + 4, 20, blk, 7));
  back = dev_down(be, blk, 21);
  for (size_t i = 0; i < 3; i++)
    for (size_t j = 0; j < 7; j++)
      assert_true(back[i * 7 + j] == (j < 5 ? h[(2 + i) * 20 + 4 + j] : -1.0f));
  free(back);

  ac_free(be, big);
  ac_free(be, blk);
  ac_free(be, di);
  ac_free(be, a);
  ac_free(be, b);
  free(h);
}

static void test_permute(void **state) {
  ac_backend *be = backend(state);
  /* Attention heads: (B, T, 3, H, Dh) -> (3, B, H, T, Dh). */
  const size_t shape[5] = {2, 5, 3, 4, 6};
  const int perm[5] = {2, 0, 3, 1, 4};
  const size_t n = 2 * 5 * 3 * 4 * 6;
  float *h = host_rand(n);
  float *x = dev_up(be, h, n), *y = dev_alloc(be, n * sizeof(float));
  OK(ac_permute(be, 5, shape, perm, x, y));
  float *got = dev_down(be, y, n);
  double *want = dzeros(n);
  size_t o = 0;
  for (size_t s = 0; s < 3; s++)
    for (size_t b = 0; b < 2; b++)
      for (size_t hh = 0; hh < 4; hh++)
        for (size_t t = 0; t < 5; t++)
          for (size_t d = 0; d < 6; d++) want[o++] = h[(((b * 5 + t) * 3 + s) * 4 + hh) * 6 + d];
  expect_close("permute", got, want, n, 0, 0);
  free(got);
  free(want);

  /* 2-D transpose. */
  const size_t s2[2] = {7, 9};
  const int p2[2] = {1, 0};
  OK(ac_permute(be, 2, s2, p2, x, y));
  got = dev_down(be, y, 63);
  for (size_t i = 0; i < 9; i++)
    for (size_t j = 0; j < 7; j++) assert_true(got[i * 7 + j] == h[j * 9 + i]);
  free(got);
  ac_free(be, x);
  ac_free(be, y);
  free(h);
}

/* ------------------------------------------------------------------------------------ */
/* Linear algebra                                                                          */

static void naive_gemm(ac_trans ta, ac_trans tb, size_t m, size_t n, size_t k, double alpha,
                       const float *a, size_t lda, const float *b, size_t ldb, double beta,
                       const float *c0, size_t ldc, double *c) {
  for (size_t i = 0; i < m; i++)
    for (size_t j = 0; j < n; j++) {
      double s = 0.0;
      for (size_t p = 0; p < k; p++) {
        double av = ta == AC_NO_TRANS ? a[i * lda + p] : a[p * lda + i];
        double bv = tb == AC_NO_TRANS ? b[p * ldb + j] : b[j * ldb + p];
        s += av * bv;
      }
      c[i * ldc + j] = alpha * s + (beta == 0.0 ? 0.0 : beta * c0[i * ldc + j]);
    }
}

static void test_sgemm(void **state) {
  ac_backend *be = backend(state);
  const size_t m = 13, n = 17, k = 11, batch = 3;
  const size_t lda = 20, ldb = 21, ldc = 19; /* padded leading dimensions */
  const size_t sa = 20 * 20, sb = 21 * 21, sc = 19 * 14;
  float *ha = host_rand(sa * batch), *hb = host_rand(sb * batch), *hc = host_rand(sc * batch);
  float *a = dev_up(be, ha, sa * batch), *b = dev_up(be, hb, sb * batch);

  for (int ta = 0; ta < 2; ta++)
    for (int tb = 0; tb < 2; tb++)
      for (int shared_b = 0; shared_b < 2; shared_b++) {
        float *c = dev_up(be, hc, sc * batch);
        size_t stride_b = shared_b ? 0 : sb;
        OK(ac_sgemm_batched(be, (ac_trans)ta, (ac_trans)tb, m, n, k, 0.75f, a, lda, sa, b, ldb,
                            stride_b, -0.5f, c, ldc, sc, batch));
        float *got = dev_down(be, c, sc * batch);
        for (size_t i = 0; i < batch; i++) {
          double *want = dzeros(sc);
          for (size_t e = 0; e < sc; e++)
            want[e] = hc[i * sc + e]; /* padding must stay untouched */
          naive_gemm((ac_trans)ta, (ac_trans)tb, m, n, k, 0.75, ha + i * sa, lda, hb + i * stride_b,
                     ldb, -0.5, hc + i * sc, ldc, want);
          expect_close("sgemm_batched", got + i * sc, want, sc, 1e-5, 1e-5);
          free(want);
        }
        free(got);
        ac_free(be, c);
      }

  /* beta = 0 ignores NaN in C; k = 0 gives beta C. */
  float *hnan = host_zeros(m * n);
  for (size_t i = 0; i < m * n; i++) hnan[i] = NAN;
  float *c = dev_up(be, hnan, m * n);
  OK(ac_sgemm(be, AC_NO_TRANS, AC_TRANS, m, n, k, 1.0f, a, lda, b, ldb, 0.0f, c, n));
  float *got = dev_down(be, c, m * n);
  double *want = dzeros(m * n);
  naive_gemm(AC_NO_TRANS, AC_TRANS, m, n, k, 1.0, ha, lda, hb, ldb, 0.0, NULL, n, want);
  expect_close("sgemm beta=0", got, want, m * n, 1e-5, 1e-5);
  free(got);
  OK(ac_sgemm(be, AC_NO_TRANS, AC_NO_TRANS, m, n, 0, 1.0f, NULL, 0, NULL, 0, 2.0f, c, n));
  got = dev_down(be, c, m * n);
  for (size_t i = 0; i < m * n; i++) want[i] *= 2.0;
  expect_close("sgemm k=0", got, want, m * n, 1e-5, 1e-5);
  free(got);
  free(want);
  free(hnan);
  ac_free(be, c);

  ac_free(be, a);
  ac_free(be, b);
  free(ha);
  free(hb);
  free(hc);
}

/* The small blocks' products (Shampoo's 128-blocks: the CPU backend's own AVX-512F kernel,
 * gemm_small.c, where the processor has it; cuBLAS on CUDA): every transpose, square and
 * ragged shapes (rows past a tile of 8, columns past a tile of 32, masked), padded leading
 * dimensions whose padding must stay untouched, beta 0 over NaN and beta != 0. Each value
 * against the double sum within the float error bound of a k-term sum, k u sum |a b|
 * (Higham's gamma_k, u = 2^-24), alpha and beta included. */
static void test_sgemm_small_blocks(void **state) {
  ac_backend *be = backend(state);
  /* the last: a 1 x 1 result, a dot product on the CPU (K-FAC's KL clip) */
  const size_t shapes[][3] = {
      {128, 128, 128}, {256, 128, 64}, {129, 47, 100}, {45, 70, 100}, {1, 1, 1000}};
  for (size_t sh = 0; sh < sizeof shapes / sizeof shapes[0]; sh++)
    for (int ta = 0; ta < 2; ta++)
      for (int tb = 0; tb < 2; tb++)
        for (int zero_beta = 0; zero_beta < 2; zero_beta++) {
          const size_t m = shapes[sh][0], n = shapes[sh][1], k = shapes[sh][2];
          const size_t lda = (ta ? m : k) + 3, ldb = (tb ? k : n) + 5, ldc = n + 7;
          const size_t na = (ta ? k : m) * lda, nb = (tb ? n : k) * ldb, nc = m * ldc;
          const float alpha = 0.75f, beta = zero_beta ? 0.0f : -0.5f;
          float *ha = host_rand(na), *hb = host_rand(nb), *hc = host_rand(nc);
          for (size_t i = 0; zero_beta && i < m; i++)
            for (size_t j = 0; j < n; j++) hc[i * ldc + j] = NAN;
          float *a = dev_up(be, ha, na), *b = dev_up(be, hb, nb), *c = dev_up(be, hc, nc);
          OK(ac_sgemm(be, (ac_trans)ta, (ac_trans)tb, m, n, k, alpha, a, lda, b, ldb, beta, c,
                      ldc));
          float *got = dev_down(be, c, nc);
          for (size_t i = 0; i < m; i++) {
            for (size_t j = 0; j < n; j++) {
              double sum = 0.0, mag = 0.0;
              for (size_t p = 0; p < k; p++) {
                double t = (double)(ta ? ha[p * lda + i] : ha[i * lda + p]) *
                           (double)(tb ? hb[j * ldb + p] : hb[p * ldb + j]);
                sum += t;
                mag += fabs(t);
              }
              const double c0 = zero_beta ? 0.0 : hc[i * ldc + j];
              const double want = alpha * sum + beta * c0;
              const double bound = ((double)k + 2.0) * 0x1p-24 * (alpha * mag + fabs(beta * c0));
              if (!(fabs((double)got[i * ldc + j] - want) <= bound)) {
                print_error(
                    "sgemm %zux%zux%zu ta %d tb %d beta %g: C[%zu][%zu] is %.9g, "
                    "expected %.9g within %.3g\n",
                    m, n, k, ta, tb, (double)beta, i, j, (double)got[i * ldc + j], want, bound);
                fail();
              }
            }
            for (size_t j = n; j < ldc; j++) assert_true(got[i * ldc + j] == hc[i * ldc + j]);
          }
          free(got);
          ac_free(be, a);
          ac_free(be, b);
          ac_free(be, c);
          free(ha);
          free(hb);
          free(hc);
        }
}

/* The CPU backend's small-block kernel (AVX-512F, gemm_small.c) against OpenBLAS's (the
 * backend capped at AVX2): both within float reassociation of each other, on Shampoo's
 * shapes, and the same bits on 1 and 2 threads (the kernel is chosen by shape alone). The
 * largest difference is printed: it is what changing kernels changes in a Shampoo step. */
static void test_cpu_sgemm_small_vs_openblas(void **state) {
  (void)state;
  ac_backend *wide[2], *blas[2];
  cpu_pair_isa(wide, AC_CPU_ISA_BEST);
  cpu_pair_isa(blas, AC_CPU_ISA_AVX2);
  const size_t n = 128, big = 512; /* a 128-block of a 512 x 128 gradient */
  float *l = host_rand(n * n), *g = host_rand(big * n), *out[4];
  double maxrel = 0.0;
  ac_backend *bes[4] = {wide[0], wide[1], blas[0], blas[1]};
  for (int e = 0; e < 4; e++) {
    float *dl = dev_up(bes[e], l, n * n), *dg = dev_up(bes[e], g, big * n);
    float *c = dev_alloc(bes[e], n * n * sizeof(float));
    /* L G_b with G_b rows 128..255 of the gradient (lda of G is n) */
    OK(ac_sgemm(bes[e], AC_NO_TRANS, AC_NO_TRANS, n, n, n, 1.0f, dl, n, dg + n * n, n, 0.0f, c, n));
    out[e] = dev_down(bes[e], c, n * n);
    ac_free(bes[e], dl);
    ac_free(bes[e], dg);
    ac_free(bes[e], c);
  }
  assert_memory_equal(out[0], out[1], n * n * sizeof(float));
  assert_memory_equal(out[2], out[3], n * n * sizeof(float));
  for (size_t i = 0; i < n * n; i++) {
    double d = fabs((double)out[0][i] - out[2][i]), s = fabs((double)out[2][i]) + 1e-3;
    if (d / s > maxrel) maxrel = d / s;
    assert_true(d <= 130.0 * 0x1p-24 * 2.0 * 128.0); /* gamma_k of both, |terms| <= 1 */
  }
  print_message("small-block kernel vs OpenBLAS, 128^3: largest relative difference %.3g\n",
                maxrel);
  for (int e = 0; e < 4; e++) {
    free(out[e]);
    ac_backend_destroy(bes[e]);
  }
  free(l);
  free(g);
}

static size_t packed_at(size_t n, size_t i, size_t j) {
  /* Row i of the packed upper triangle starts after rows 0..i-1 of lengths n, n-1, ... */
  size_t start = 0;
  for (size_t r = 0; r < i; r++) start += n - r;
  return start + (j - i);
}

static void test_syrk_packed(void **state) {
  ac_backend *be = backend(state);
  /* A block of rows x cols at (1, 2) inside a 12 x 15 gradient (row stride 15). */
  const size_t rows = 9, cols = 6, ld = 15;
  float *hg = host_rand(12 * ld);
  float *g = dev_up(be, hg, 12 * ld);
  const float *blk = hg + 1 * ld + 2;

  for (int t = 0; t < 2; t++) {
    size_t n = t == 0 ? rows : cols, k = t == 0 ? cols : rows;
    size_t len = ac_packed_len(n);
    assert_int_equal(len, n * (n + 1) / 2);
    float *hc = host_rand(len);
    float *c = dev_up(be, hc, len);
    /* EMA form: c = 0.1 g g^T + 0.9 c. */
    OK(ac_syrk_packed(be, (ac_trans)t, n, k, 0.1f, g + 1 * ld + 2, ld, 0.9f, c));
    float *got = dev_down(be, c, len);
    double *want = dzeros(len);
    for (size_t i = 0; i < n; i++)
      for (size_t j = i; j < n; j++) {
        double s = 0.0;
        for (size_t p = 0; p < k; p++)
          s += t == 0 ? (double)blk[i * ld + p] * blk[j * ld + p]
                      : (double)blk[p * ld + i] * blk[p * ld + j];
        size_t at = packed_at(n, i, j);
        want[at] = 0.1 * s + 0.9 * hc[at];
      }
    expect_close(t == 0 ? "syrk G G^T" : "syrk G^T G", got, want, len, 1e-5, 1e-5);

    /* beta = 0 overwrites; then unpack and pack round-trip. */
    OK(ac_syrk_packed(be, (ac_trans)t, n, k, 1.0f, g + 1 * ld + 2, ld, 0.0f, c));
    free(got);
    got = dev_down(be, c, len);
    float *dense = dev_alloc(be, n * (n + 3) * sizeof(float));
    OK(ac_unpack_sym(be, n, c, dense, n + 3));
    float *hd = dev_down(be, dense, n * (n + 3));
    for (size_t i = 0; i < n; i++)
      for (size_t j = 0; j < n; j++) {
        size_t at = i <= j ? packed_at(n, i, j) : packed_at(n, j, i);
        assert_true(hd[i * (n + 3) + j] == got[at]);
      }
    float *c2 = dev_alloc(be, len * sizeof(float));
    OK(ac_pack_sym(be, n, dense, n + 3, c2));
    float *back = dev_down(be, c2, len);
    assert_memory_equal(back, got, len * sizeof(float));
    free(back);
    free(hd);
    ac_free(be, c2);
    ac_free(be, dense);
    free(got);
    free(want);
    free(hc);
    ac_free(be, c);
  }
  ac_free(be, g);
  free(hg);
}

/* The statistics of Shampoo-sized blocks (the CPU backend's small-block kernel writes the
 * packed triangle itself, gemm_small.c): blocks of 128 x 128, an order of 520 from 100 rows
 * (K-FAC's dense factors; its other side, k 520, is OpenBLAS's) and ragged ones (orders past
 * tiles of 8 rows and 32 columns, the diagonal inside a tile) inside a wider gradient, both
 * sides, the EMA form over NaN-free old values and beta 0 over NaN, every value within the
 * float bound of its k-term sum; the floats past the triangle are never written. */
static void test_syrk_small_blocks(void **state) {
  ac_backend *be = backend(state);
  /* rows x cols of a block; the last: orders past 256 (G^T G of 520, K-FAC's dense factors) */
  const size_t shapes[][2] = {{128, 128}, {100, 77}, {45, 200}, {100, 520}};
  const size_t ld = 530;
  float *hg = host_rand(200 * ld);
  float *g = dev_up(be, hg, 200 * ld);
  for (size_t sh = 0; sh < sizeof shapes / sizeof shapes[0]; sh++)
    for (int t = 0; t < 2; t++)
      for (int zero_beta = 0; zero_beta < 2; zero_beta++) {
        const size_t rows = shapes[sh][0], cols = shapes[sh][1];
        const size_t n = t == 0 ? rows : cols, k = t == 0 ? cols : rows, len = ac_packed_len(n);
        const float *blk = hg + 3 * ld + 5;
        const float alpha = zero_beta ? 1.0f : 0.05f, beta = zero_beta ? 0.0f : 0.95f;
        float *hc = host_rand(len + 16);
        for (size_t i = 0; zero_beta && i < len; i++) hc[i] = NAN;
        float *c = dev_up(be, hc, len + 16);
        OK(ac_syrk_packed(be, (ac_trans)t, n, k, alpha, g + 3 * ld + 5, ld, beta, c));
        float *got = dev_down(be, c, len + 16);
        for (size_t i = 0; i < n; i++)
          for (size_t j = i; j < n; j++) {
            double sum = 0.0, mag = 0.0;
            for (size_t p = 0; p < k; p++) {
              double v = t == 0 ? (double)blk[i * ld + p] * blk[j * ld + p]
                                : (double)blk[p * ld + i] * blk[p * ld + j];
              sum += v;
              mag += fabs(v);
            }
            const size_t at = packed_at(n, i, j);
            const double c0 = zero_beta ? 0.0 : hc[at], want = alpha * sum + beta * c0;
            const double bound = ((double)k + 2.0) * 0x1p-24 * (alpha * mag + fabs(beta * c0));
            if (!(fabs((double)got[at] - want) <= bound)) {
              print_error(
                  "syrk n %zu k %zu trans %d beta %g: (%zu, %zu) is %.9g, expected %.9g "
                  "within %.3g\n",
                  n, k, t, (double)beta, i, j, (double)got[at], want, bound);
              fail();
            }
          }
        for (size_t i = len; i < len + 16; i++) assert_true(got[i] == hc[i]);
        free(got);
        free(hc);
        ac_free(be, c);
      }
  ac_free(be, g);
  free(hg);
}

/* ac_syrk_packed_to_host gives ac_syrk_packed's floats (beta 0, then a download) in the
 * caller's host memory, writes nothing past the triangle, zeros for k = 0, and checks its
 * arguments. */
static void test_syrk_packed_to_host(void **state) {
  ac_backend *be = backend(state);
  const size_t rows = 9, cols = 6, ld = 15;
  float *hg = host_rand(12 * ld);
  float *g = dev_up(be, hg, 12 * ld);
  for (int t = 0; t < 2; t++) {
    size_t n = t == 0 ? rows : cols, k = t == 0 ? cols : rows, len = ac_packed_len(n);
    float *c = dev_alloc(be, len * sizeof(float));
    OK(ac_syrk_packed(be, (ac_trans)t, n, k, 0.5f, g + 1 * ld + 2, ld, 0.0f, c));
    float *want = dev_down(be, c, len);
    float *got = host_rand(len + 1); /* garbage to overwrite, and a guard after it */
    const float guard = got[len];
    OK(ac_syrk_packed_to_host(be, (ac_trans)t, n, k, 0.5f, g + 1 * ld + 2, ld, got));
    assert_memory_equal(got, want, len * sizeof(float));
    assert_true(got[len] == guard);
    OK(ac_syrk_packed_to_host(be, (ac_trans)t, n, 0, 0.5f, NULL, ld, got));
    for (size_t i = 0; i < len; i++) assert_true(got[i] == 0.0f);
    free(got);
    free(want);
    ac_free(be, c);
  }
  float one = 0.0f;
  assert_int_equal(ac_syrk_packed_to_host(be, AC_NO_TRANS, 4, 3, 1, g, 2, &one), AC_EINVAL);
  assert_int_equal(ac_syrk_packed_to_host(be, AC_NO_TRANS, 4, 3, 1, g, 3, NULL), AC_EINVAL);
  assert_int_equal(ac_syrk_packed_to_host(NULL, AC_NO_TRANS, 1, 1, 1, g, 1, &one), AC_EINVAL);
  OK(ac_syrk_packed_to_host(be, AC_NO_TRANS, 0, 3, 1, g, 3, NULL)); /* nothing to write */
  ac_free(be, g);
  free(hg);
}

/* ------------------------------------------------------------------------------------ */
/* Elementwise                                                                             */

static void test_binary_axpby_affine(void **state) {
  ac_backend *be = backend(state);
  const size_t n = 777;
  float *ha = host_rand(n), *hb = host_rand(n);
  for (size_t i = 0; i < n; i++) hb[i] += hb[i] >= 0 ? 0.5f : -0.5f; /* away from zero for DIV */
  float *a = dev_up(be, ha, n), *b = dev_up(be, hb, n), *o = dev_alloc(be, n * sizeof(float));
  double *want = dzeros(n);

  for (int op = AC_BIN_ADD; op <= AC_BIN_DIV; op++) {
    OK(ac_binary(be, (ac_binary_op)op, n, a, b, o));
    float *got = dev_down(be, o, n);
    for (size_t i = 0; i < n; i++) {
      double x = ha[i], y = hb[i];
      want[i] = op == AC_BIN_ADD   ? x + y
                : op == AC_BIN_SUB ? x - y
                : op == AC_BIN_MUL ? x * y
                                   : x / y;
    }
    expect_close("binary", got, want, n, 1e-7, 1e-6);
    free(got);
  }

  /* In place: o = o * b. */
  OK(ac_memcpy_d2d(be, o, a, n * sizeof(float)));
  OK(ac_binary(be, AC_BIN_MUL, n, o, b, o));
  float *got = dev_down(be, o, n);
  for (size_t i = 0; i < n; i++) want[i] = (double)ha[i] * hb[i];
  expect_close("binary in place", got, want, n, 1e-7, 1e-6);
  free(got);

  /* axpy in place on y, and scale with y NULL. */
  OK(ac_memcpy_d2d(be, o, b, n * sizeof(float)));
  OK(ac_axpby(be, n, 2.0f, a, 1.0f, o, o));
  got = dev_down(be, o, n);
  for (size_t i = 0; i < n; i++) want[i] = 2.0 * ha[i] + hb[i];
  expect_close("axpy", got, want, n, 1e-6, 1e-6);
  free(got);
  OK(ac_axpby(be, n, -3.0f, a, 0.0f, NULL, o));
  got = dev_down(be, o, n);
  for (size_t i = 0; i < n; i++) want[i] = -3.0 * ha[i];
  expect_close("scale", got, want, n, 1e-6, 1e-6);
  free(got);
  OK(ac_axpby(be, n, 0.5f, a, -0.25f, b, o));
  got = dev_down(be, o, n);
  for (size_t i = 0; i < n; i++) want[i] = 0.5 * ha[i] - 0.25 * hb[i];
  expect_close("axpby", got, want, n, 1e-6, 1e-6);
  free(got);

  OK(ac_affine(be, n, 3.0f, a, 1e-3f, o));
  got = dev_down(be, o, n);
  for (size_t i = 0; i < n; i++) want[i] = 3.0 * ha[i] + 1e-3;
  expect_close("affine", got, want, n, 1e-6, 1e-6);
  free(got);

  free(want);
  free(ha);
  free(hb);
  ac_free(be, a);
  ac_free(be, b);
  ac_free(be, o);
}

/* The unary ops in double, written from their definitions. */
static double ref_unary(ac_unary_op op, double x) {
  switch (op) {
    case AC_UNARY_RELU:
      return x > 0 ? x : 0;
    case AC_UNARY_GELU:
      return 0.5 * x * (1 + tanh(sqrt(2 / M_PI) * (x + 0.044715 * x * x * x)));
    case AC_UNARY_EXP:
      return exp(x);
    case AC_UNARY_LOG:
      return log(x);
    case AC_UNARY_SQRT:
      return sqrt(x);
    case AC_UNARY_RSQRT:
      return 1 / sqrt(x);
    case AC_UNARY_TANH:
      return tanh(x);
    case AC_UNARY_SIGMOID:
      return 1 / (1 + exp(-x));
    case AC_UNARY_SQUARE:
      return x * x;
    case AC_UNARY_ABS:
      return fabs(x);
    case AC_UNARY_NEG:
      return -x;
    case AC_UNARY_RECIP:
      return 1 / x;
    default:
      return NAN;
  }
}

static int positive_domain(ac_unary_op op) {
  return op == AC_UNARY_LOG || op == AC_UNARY_SQRT || op == AC_UNARY_RSQRT || op == AC_UNARY_RECIP;
}

static void test_unary(void **state) {
  ac_backend *be = backend(state);
  const size_t n = 501;
  float *hx = host_rand(n), *hdy = host_rand(n);
  double *want = dzeros(n);
  float *dx = dev_alloc(be, n * sizeof(float)), *o = dev_alloc(be, n * sizeof(float));
  float *dy = dev_up(be, hdy, n);

  for (int op = 0; op < AC_UNARY_COUNT; op++) {
    float *h = host_zeros(n);
    for (size_t i = 0; i < n; i++) {
      /* Inputs in the op's domain and away from kinks (finite differences below). */
      float v = 3.0f * hx[i];
      if (positive_domain((ac_unary_op)op))
        v = 0.2f + fabsf(v);
      else if (fabsf(v) < 0.01f)
        v = 0.25f;
      h[i] = v;
    }
    float *x = dev_up(be, h, n);
    assert_true(strlen(ac_unary_name((ac_unary_op)op)) > 1);
    OK(ac_unary(be, (ac_unary_op)op, n, x, o));
    float *got = dev_down(be, o, n);
    for (size_t i = 0; i < n; i++) want[i] = ref_unary((ac_unary_op)op, h[i]);
    expect_close(ac_unary_name((ac_unary_op)op), got, want, n, 1e-6, 2e-6);
    free(got);

    /* Backward against a central difference of the double reference. */
    OK(ac_unary_backward(be, (ac_unary_op)op, n, x, dy, dx));
    got = dev_down(be, dx, n);
    for (size_t i = 0; i < n; i++) {
      double e = 1e-6 * (1 + fabs(h[i]));
      double d =
          (ref_unary((ac_unary_op)op, h[i] + e) - ref_unary((ac_unary_op)op, h[i] - e)) / (2 * e);
      want[i] = hdy[i] * d;
    }
    expect_close(ac_unary_name((ac_unary_op)op), got, want, n, 1e-5, 1e-4);
    free(got);

    /* In place: dx aliases dy. */
    float *dyc = dev_up(be, hdy, n);
    OK(ac_unary_backward(be, (ac_unary_op)op, n, x, dyc, dyc));
    got = dev_down(be, dyc, n);
    expect_close("unary backward in place", got, want, n, 1e-5, 1e-4);
    free(got);
    ac_free(be, dyc);
    ac_free(be, x);
    free(h);
  }
  free(want);
  free(hx);
  free(hdy);
  ac_free(be, dx);
  ac_free(be, dy);
  ac_free(be, o);
}

/* ------------------------------------------------------------------------------------ */
/* Broadcasts and reductions                                                               */

static void test_bcast_reduce(void **state) {
  ac_backend *be = backend(state);
  /* The last shape is a bias gradient wide enough for CUDA's column kernel. */
  const size_t shapes[5][3] = {{7, 9, 1}, {1, 5, 33}, {3, 4, 10}, {2, 300, 1}, {5, 1100, 1}};
  for (size_t s = 0; s < 5; s++) {
    size_t outer = shapes[s][0], mid = shapes[s][1], inner = shapes[s][2];
    size_t n = outer * mid * inner;
    float *hx = host_rand(n), *hv = host_rand(mid), *hout = host_rand(mid);
    for (size_t m = 0; m < mid; m++) hv[m] += hv[m] >= 0 ? 0.5f : -0.5f;
    float *x = dev_up(be, hx, n), *v = dev_up(be, hv, mid), *y = dev_alloc(be, n * sizeof(float));
    double *want = dzeros(n);

    for (int op = AC_BIN_ADD; op <= AC_BIN_DIV; op++) {
      OK(ac_bcast(be, (ac_binary_op)op, outer, mid, inner, x, v, y));
      float *got = dev_down(be, y, n);
      for (size_t o = 0; o < outer; o++)
        for (size_t m = 0; m < mid; m++)
          for (size_t i = 0; i < inner; i++) {
            size_t at = (o * mid + m) * inner + i;
            double a = hx[at], b = hv[m];
            want[at] = op == AC_BIN_ADD   ? a + b
                       : op == AC_BIN_SUB ? a - b
                       : op == AC_BIN_MUL ? a * b
                                          : a / b;
          }
      expect_close("bcast", got, want, n, 1e-7, 1e-6);
      free(got);
    }
    /* In place. */
    OK(ac_memcpy_d2d(be, y, x, n * sizeof(float)));
    OK(ac_bcast(be, AC_BIN_DIV, outer, mid, inner, y, v, y));
    float *got = dev_down(be, y, n);
    expect_close("bcast in place", got, want, n, 1e-7, 1e-6);
    free(got);

    float *r = dev_alloc(be, mid * sizeof(float));
    for (int op = AC_REDUCE_SUM; op <= AC_REDUCE_NORM2; op++)
      for (int acc = 0; acc < 2; acc++) {
        double beta = acc ? 0.5 : 0.0;
        OK(ac_memcpy_h2d(be, r, hout, mid * sizeof(float)));
        OK(ac_reduce(be, (ac_reduce_op)op, outer, mid, inner, 2.0f, x, (float)beta, r));
        got = dev_down(be, r, mid);
        double *rw = dzeros(mid);
        for (size_t m = 0; m < mid; m++) {
          double a = op == AC_REDUCE_MAX ? -INFINITY : 0.0;
          for (size_t o = 0; o < outer; o++)
            for (size_t i = 0; i < inner; i++) {
              double e = hx[(o * mid + m) * inner + i];
              a = op == AC_REDUCE_SUM ? a + e : op == AC_REDUCE_MAX ? fmax(a, e) : a + e * e;
            }
          if (op == AC_REDUCE_NORM2) a = sqrt(a);
          rw[m] = 2.0 * a + beta * hout[m];
        }
        expect_close("reduce", got, rw, mid, 1e-5, 1e-5);
        free(rw);
        free(got);
      }
    ac_free(be, r);
    free(want);
    free(hx);
    free(hv);
    free(hout);
    ac_free(be, x);
    ac_free(be, v);
    ac_free(be, y);
  }
}

static void test_scalar_reductions_argmax(void **state) {
  ac_backend *be = backend(state);
  const size_t n = 100003;
  float *h = host_rand(n);
  float *x = dev_up(be, h, n);
  double s = 0, q = 0, sum = 0, sumsq = 0;
  for (size_t i = 0; i < n; i++) {
    sum += h[i];
    sumsq += (double)h[i] * h[i];
  }
  OK(ac_sum_to_host(be, n, x, &s));
  OK(ac_sumsq_to_host(be, n, x, &q));
  assert_true(fabs(s - sum) <= 1e-3);
  assert_true(fabs(q - sumsq) <= 1e-6 * sumsq);

  /* argmax with a tie: the first index wins. */
  const size_t rows = 37, cols = 53;
  for (size_t r = 0; r < rows; r++) h[r * cols + (r * 7) % cols] = 2.0f;
  h[5 * cols + 50] = 2.0f; /* row 5's first 2.0 is at 35 */
  OK(ac_memcpy_h2d(be, x, h, rows * cols * sizeof(float)));
  int32_t *idx = dev_alloc(be, rows * sizeof(int32_t)), hidx[37];
  OK(ac_argmax_rows(be, rows, cols, x, idx));
  OK(ac_memcpy_d2h(be, hidx, idx, sizeof hidx));
  for (size_t r = 0; r < rows; r++) assert_int_equal(hidx[r], (int32_t)((r * 7) % cols));
  ac_free(be, idx);
  ac_free(be, x);
  free(h);
}

/* Categorical draws: the inverse CDF on hand cases (boundaries, zero-probability classes,
 * an unnormalised row, ignored rows kept), then 40,000 draws of one distribution from
 * ac_rand_uniform against its probabilities (within 5 standard deviations). */
static void test_sample_rows(void **state) {
  ac_backend *be = backend(state);
  enum { COLS = 5, ROWS = 12 };
  const float hp[ROWS * COLS] = {
      0.25f, 0.25f, 0.5f, 0,    0, /* u 0: class 0 */
      0.25f, 0.25f, 0.5f, 0,    0, /* u 0.25 = the first boundary: class 1 */
      0.25f, 0.25f, 0.5f, 0,    0, /* u 0.4999: class 1 */
      0.25f, 0.25f, 0.5f, 0,    0, /* u 0.5: class 2 */
      0,     0.5f,  0,    0.5f, 0, /* u 0: never the zero-probability class 0: 1 */
      0,     0.5f,  0,    0.5f, 0, /* u 0.9999: 3, never 4 */
      1,     1,     2,    0,    0, /* unnormalised, u 0.5: target 2, class 2 */
      1,     1,     2,    0,    0, /* label -1 on entry: kept */
      1,     1,     2,    0,    0, /* label 7 (>= cols) on entry: kept */
      0,     0,     0,    0,    0, /* sum 0: the entry label kept */
      0.1f,  0.2f,  0.3f, 0.4f, 0, /* u 0.3 lands on class 1's end (0.1 + 0.2): 2 */
      0.1f,  0.2f,  0.3f, 0.4f, 0, /* u 0.95: 3 */
  };
  const float hu[ROWS] = {0,    0.25f, 0.4999f, 0.5f, 0,     0.9999f,
                          0.5f, 0.5f,  0.5f,    0.5f, 0.31f, 0.95f};
  const int32_t in[ROWS] = {0, 0, 0, 0, 0, 0, 0, -1, 7, 3, 0, 0};
  const int32_t want[ROWS] = {0, 1, 1, 2, 1, 3, 2, -1, 7, 3, 2, 3};
  float *p = dev_up(be, hp, ROWS * COLS), *u = dev_up(be, hu, ROWS);
  int32_t *lab = dev_up_i32(be, in, ROWS), got[ROWS];
  OK(ac_sample_rows(be, ROWS, COLS, p, u, lab));
  OK(ac_memcpy_d2h(be, got, lab, sizeof got));
  for (int r = 0; r < ROWS; r++) assert_int_equal(got[r], want[r]);
  assert_int_equal(ac_sample_rows(be, ROWS, COLS, NULL, u, lab), AC_EINVAL);
  assert_int_equal(ac_sample_rows(be, ROWS, 0, p, u, lab), AC_EINVAL);
  OK(ac_sample_rows(be, 0, COLS, p, u, lab));
  ac_free(be, p);
  ac_free(be, u);
  ac_free(be, lab);

  /* Frequencies: one softmax row repeated, uniforms from the counter-based generator. */
  enum { DRAWS = 40000 };
  const float dist[COLS] = {0.05f, 0.15f, 0.3f, 0.4f, 0.1f};
  float *hd = malloc(DRAWS * COLS * sizeof *hd);
  int32_t *hl = malloc(DRAWS * sizeof *hl);
  assert_non_null(hd);
  assert_non_null(hl);
  for (size_t r = 0; r < DRAWS; r++) {
    memcpy(hd + r * COLS, dist, sizeof dist);
    hl[r] = 0;
  }
  p = dev_up(be, hd, DRAWS * COLS);
  u = dev_alloc(be, DRAWS * sizeof(float));
  lab = dev_up_i32(be, hl, DRAWS);
  OK(ac_rand_uniform(be, 99, 0, DRAWS, 0.0f, 1.0f, u));
  OK(ac_sample_rows(be, DRAWS, COLS, p, u, lab));
  OK(ac_memcpy_d2h(be, hl, lab, DRAWS * sizeof *hl));
  size_t count[COLS] = {0};
  for (size_t r = 0; r < DRAWS; r++) {
    assert_true(hl[r] >= 0 && hl[r] < COLS);
    count[hl[r]]++;
  }
  for (int j = 0; j < COLS; j++) {
    double mean = DRAWS * (double)dist[j], sd = sqrt(mean * (1.0 - (double)dist[j]));
    assert_true(fabs((double)count[j] - mean) < 5.0 * sd);
  }
  ac_free(be, p);
  ac_free(be, u);
  ac_free(be, lab);
  free(hd);
  free(hl);
}

/* ------------------------------------------------------------------------------------ */
/* Softmax, mask, cross-entropy                                                            */

static void ref_softmax(size_t cols, const float *x, double *y) {
  double mx = -INFINITY, s = 0;
  for (size_t j = 0; j < cols; j++) mx = fmax(mx, x[j]);
  for (size_t j = 0; j < cols; j++) s += exp(x[j] - mx);
  for (size_t j = 0; j < cols; j++) y[j] = exp(x[j] - mx) / s;
}

static void test_softmax_mask(void **state) {
  ac_backend *be = backend(state);
  const size_t batch = 3, t = 17, rows = batch * t, cols = t, n = rows * cols;
  float *hx = host_rand(n), *hdy = host_rand(n);
  for (size_t i = 0; i < n; i++) hx[i] *= 30.0f; /* large logits: stability matters */
  float *x = dev_up(be, hx, n), *y = dev_alloc(be, n * sizeof(float));
  float *dy = dev_up(be, hdy, n);

  OK(ac_mask_causal(be, batch, t, x, -INFINITY));
  float *masked = dev_down(be, x, n);
  for (size_t b = 0; b < batch; b++)
    for (size_t i = 0; i < t; i++)
      for (size_t j = 0; j < t; j++) {
        size_t at = (b * t + i) * t + j;
        if (j > i)
          assert_true(isinf(masked[at]) && masked[at] < 0);
        else
          assert_true(masked[at] == hx[at]);
      }

  OK(ac_softmax_rows(be, rows, cols, x, y));
  float *got = dev_down(be, y, n);
  double *want = dzeros(n);
  for (size_t r = 0; r < rows; r++) ref_softmax(cols, masked + r * cols, want + r * cols);
  expect_close("softmax (causal)", got, want, n, 1e-6, 1e-5);

  /* Backward from the output. */
  float *dx = dev_alloc(be, n * sizeof(float));
  OK(ac_softmax_rows_backward(be, rows, cols, y, dy, dx));
  float *gdx = dev_down(be, dx, n);
  double *wdx = dzeros(n);
  for (size_t r = 0; r < rows; r++) {
    double dot = 0;
    for (size_t j = 0; j < cols; j++) dot += (double)hdy[r * cols + j] * got[r * cols + j];
    for (size_t j = 0; j < cols; j++)
      wdx[r * cols + j] = got[r * cols + j] * (hdy[r * cols + j] - dot);
  }
  expect_close("softmax backward", gdx, wdx, n, 1e-6, 1e-5);

  /* In place forward. */
  OK(ac_softmax_rows(be, rows, cols, x, x));
  free(got);
  got = dev_down(be, x, n);
  expect_close("softmax in place", got, want, n, 1e-6, 1e-5);

  free(gdx);
  free(wdx);
  free(got);
  free(want);
  free(masked);
  free(hx);
  free(hdy);
  ac_free(be, x);
  ac_free(be, y);
  ac_free(be, dy);
  ac_free(be, dx);
}

static void test_xent(void **state) {
  ac_backend *be = backend(state);
  const size_t rows = 29, cols = 1000, n = rows * cols;
  float *hx = host_rand(n);
  for (size_t i = 0; i < n; i++) hx[i] *= 20.0f;
  int32_t hl[29];
  for (size_t r = 0; r < rows; r++) hl[r] = (int32_t)((r * 37) % cols);
  hl[3] = -1;            /* padding: ignored */
  hl[7] = (int32_t)cols; /* out of range: ignored, no crash */
  float *x = dev_up(be, hx, n), *loss = dev_alloc(be, rows * sizeof(float));
  int32_t *labels = dev_up_i32(be, hl, rows);

  /* probs aliases logits. */
  OK(ac_xent_forward(be, rows, cols, x, labels, x, loss));
  float *gl = dev_down(be, loss, rows), *gp = dev_down(be, x, n);
  double *wp = dzeros(n), wl[29];
  for (size_t r = 0; r < rows; r++) {
    ref_softmax(cols, hx + r * cols, wp + r * cols);
    int counted = hl[r] >= 0 && (size_t)hl[r] < cols;
    wl[r] = counted ? -log(wp[r * cols + hl[r]]) : 0.0;
  }
  expect_close("xent probs", gp, wp, n, 1e-6, 1e-5);
  expect_close("xent loss", gl, wl, rows, 1e-4, 1e-5);

  float *d = dev_alloc(be, n * sizeof(float));
  OK(ac_xent_backward(be, rows, cols, x, labels, 0.25f, d));
  float *gd = dev_down(be, d, n);
  for (size_t r = 0; r < rows; r++) {
    int counted = hl[r] >= 0 && (size_t)hl[r] < cols;
    for (size_t j = 0; j < cols; j++)
      wp[r * cols + j] = counted ? 0.25 * (gp[r * cols + j] - ((size_t)hl[r] == j)) : 0.0;
  }
  expect_close("xent backward", gd, wp, n, 1e-7, 1e-6);

  free(gd);
  free(gl);
  free(gp);
  free(wp);
  free(hx);
  ac_free(be, x);
  ac_free(be, d);
  ac_free(be, loss);
  ac_free(be, labels);
}

/* ------------------------------------------------------------------------------------ */
/* Layer normalisation                                                                     */

/* Forward in double; returns sum_j w[j] y[j] of one row (the test's scalar loss). */
static double ref_layernorm_row(size_t cols, const double *x, const float *gamma, const float *beta,
                                double eps, double *y, const float *w) {
  double mu = 0, var = 0, loss = 0;
  for (size_t j = 0; j < cols; j++) mu += x[j];
  mu /= (double)cols;
  for (size_t j = 0; j < cols; j++) var += (x[j] - mu) * (x[j] - mu);
  var /= (double)cols;
  for (size_t j = 0; j < cols; j++) {
    double v = (x[j] - mu) / sqrt(var + eps) * gamma[j] + (beta ? beta[j] : 0.0);
    if (y) y[j] = v;
    if (w) loss += w[j] * v;
  }
  return loss;
}

static void test_layernorm(void **state) {
  ac_backend *be = backend(state);
  const size_t rows = 9, cols = 300, n = rows * cols;
  const float eps = 1e-5f;
  float *hx = host_rand(n), *hg = host_rand(cols), *hb = host_rand(cols), *hdy = host_rand(n);
  for (size_t i = 0; i < n; i++) hx[i] = 3.0f * hx[i] + 1.0f; /* a mean to remove */
  float *x = dev_up(be, hx, n), *g = dev_up(be, hg, cols), *b = dev_up(be, hb, cols);
  float *dy = dev_up(be, hdy, n), *y = dev_alloc(be, n * sizeof(float));
  float *mean = dev_alloc(be, rows * sizeof(float)), *rstd = dev_alloc(be, rows * sizeof(float));
  float *dx = dev_alloc(be, n * sizeof(float));
  float *dg = dev_alloc(be, cols * sizeof(float)), *db = dev_alloc(be, cols * sizeof(float));

  OK(ac_layernorm_rows(be, rows, cols, eps, x, g, b, y, mean, rstd));
  float *gy = dev_down(be, y, n);
  double *wy = dzeros(n), *row = dzeros(cols);
  for (size_t r = 0; r < rows; r++) {
    for (size_t j = 0; j < cols; j++) row[j] = hx[r * cols + j];
    ref_layernorm_row(cols, row, hg, hb, eps, wy + r * cols, NULL);
  }
  expect_close("layernorm forward", gy, wy, n, 1e-5, 1e-5);

  /* Backward against central differences of the double forward; gradients accumulate. */
  OK(ac_fill_f32(be, cols, dg, 1.0f));
  OK(ac_fill_f32(be, cols, db, 1.0f));
  OK(ac_layernorm_rows_backward(be, rows, cols, x, g, mean, rstd, dy, dx, dg, db));
  float *gdx = dev_down(be, dx, n), *gdg = dev_down(be, dg, cols), *gdb = dev_down(be, db, cols);
  double *wdx = dzeros(n), *wdg = dzeros(cols), *wdb = dzeros(cols);
  float *gp = malloc(cols * sizeof *gp);
  assert_non_null(gp);
  for (size_t j = 0; j < cols; j++) wdg[j] = wdb[j] = 1.0;
  for (size_t r = 0; r < rows; r++) {
    const float *w = hdy + r * cols;
    for (size_t j = 0; j < cols; j++) row[j] = hx[r * cols + j];
    for (size_t j = 0; j < cols; j++) {
      double h = 1e-4, keep = row[j];
      row[j] = keep + h;
      double lp = ref_layernorm_row(cols, row, hg, hb, eps, NULL, w);
      row[j] = keep - h;
      double lm = ref_layernorm_row(cols, row, hg, hb, eps, NULL, w);
      row[j] = keep;
      wdx[r * cols + j] = (lp - lm) / (2 * h);
    }
    double mu = 0, var = 0;
    for (size_t j = 0; j < cols; j++) mu += row[j];
    mu /= (double)cols;
    for (size_t j = 0; j < cols; j++) var += (row[j] - mu) * (row[j] - mu);
    var /= (double)cols;
    for (size_t j = 0; j < cols; j++) {
      wdg[j] += w[j] * (row[j] - mu) / sqrt(var + eps);
      wdb[j] += w[j];
    }
  }
  expect_close("layernorm dx", gdx, wdx, n, 1e-4, 1e-3);
  expect_close("layernorm dgamma", gdg, wdg, cols, 1e-4, 1e-5);
  expect_close("layernorm dbeta", gdb, wdb, cols, 1e-5, 1e-5);

  /* No beta; in place forward (y = x) and backward (dx = dy). */
  OK(ac_layernorm_rows(be, rows, cols, eps, x, g, NULL, x, mean, rstd));
  float *gx = dev_down(be, x, n);
  for (size_t i = 0; i < n; i++) wy[i] -= hb[i % cols];
  expect_close("layernorm in place, no beta", gx, wy, n, 1e-5, 1e-5);
  OK(ac_memcpy_h2d(be, x, hx, n * sizeof(float)));
  OK(ac_fill_f32(be, cols, dg, 1.0f));
  OK(ac_layernorm_rows_backward(be, rows, cols, x, g, mean, rstd, dy, dy, dg, NULL));
  free(gdx);
  gdx = dev_down(be, dy, n);
  expect_close("layernorm dx in place", gdx, wdx, n, 1e-4, 1e-3);
  assert_int_equal(ac_layernorm_rows(be, rows, cols, 0.0f, x, g, b, y, mean, rstd), AC_EINVAL);
  assert_int_equal(ac_layernorm_rows_backward(be, rows, cols, x, g, mean, rstd, dy, dx, dg, dg),
                   AC_EINVAL);

  free(gp);
  free(gx);
  free(gy);
  free(gdx);
  free(gdg);
  free(gdb);
  free(wy);
  free(wdx);
  free(wdg);
  free(wdb);
  free(row);
  free(hx);
  free(hg);
  free(hb);
  free(hdy);
  ac_free(be, x);
  ac_free(be, g);
  ac_free(be, b);
  ac_free(be, dy);
  ac_free(be, y);
  ac_free(be, mean);
  ac_free(be, rstd);
  ac_free(be, dx);
  ac_free(be, dg);
  ac_free(be, db);
}

/* ------------------------------------------------------------------------------------ */
/* Gathers and scatters                                                                    */

static void test_gather_scatter(void **state) {
  ac_backend *be = backend(state);
  const size_t vocab = 50, cols = 24, n = 40;
  float *ht = host_rand(vocab * cols), *hs = host_rand(n * cols);
  int32_t hi[40];
  for (size_t r = 0; r < n; r++) hi[r] = (int32_t)((r * 13) % vocab) % 17; /* many repeats */
  hi[4] = -3;
  hi[9] = (int32_t)vocab;
  float *table = dev_up(be, ht, vocab * cols), *src = dev_up(be, hs, n * cols);
  float *out = dev_alloc(be, n * cols * sizeof(float));
  int32_t *idx = dev_up_i32(be, hi, n);

  OK(ac_gather_rows(be, n, cols, table, vocab, idx, out));
  float *got = dev_down(be, out, n * cols);
  for (size_t r = 0; r < n; r++)
    for (size_t j = 0; j < cols; j++) {
      int ok = hi[r] >= 0 && (size_t)hi[r] < vocab;
      assert_true(got[r * cols + j] == (ok ? ht[(size_t)hi[r] * cols + j] : 0.0f));
    }
  free(got);

  OK(ac_scatter_add_rows(be, n, cols, src, idx, table, vocab));
  got = dev_down(be, table, vocab * cols);
  double *want = dzeros(vocab * cols);
  for (size_t e = 0; e < vocab * cols; e++) want[e] = ht[e];
  for (size_t r = 0; r < n; r++)
    if (hi[r] >= 0 && (size_t)hi[r] < vocab)
      for (size_t j = 0; j < cols; j++) want[(size_t)hi[r] * cols + j] += hs[r * cols + j];
  expect_close("scatter_add", got, want, vocab * cols, 1e-5, 1e-6); /* atomics: any order */
  free(got);
  free(want);
  free(ht);
  free(hs);
  ac_free(be, table);
  ac_free(be, src);
  ac_free(be, out);
  ac_free(be, idx);
}

/* ------------------------------------------------------------------------------------ */
/* Convolution and pooling                                                                 */

/* im2col and col2im over geometries that exercise every edge of the row-wise and plane-wise
 * copies (strides 1-3 each way, padding up to kernel size - 1 and wider than the image, 1x1 and
 * non-square kernels, a tap with no valid column), against direct loops in the test. */
static void test_im2col_geometries(void **state) {
  ac_backend *be = backend(state);
  const ac_conv2d_geom geoms[] = {
      geom(2, 2, 7, 9, 3, 3, 1, 2, 1, 1),
      geom(1, 3, 6, 8, 1, 1, 2, 2, 0, 0),
      geom(1, 2, 5, 11, 3, 5, 3, 3, 2, 4),
      geom(2, 1, 3, 1, 3, 3, 1, 1, 2, 2),
      geom(1, 2, 4, 4, 3, 3, 1, 1, 0, 0),
      /* stride 1 with ow == w: the CPU backend's one-copy-per-tap path (ragged rows that
       * wrap, whole rows of padding, a tap with no valid column) */
      geom(2, 2, 5, 6, 3, 3, 1, 1, 1, 1),
      geom(1, 2, 4, 7, 5, 3, 1, 1, 1, 1),
      geom(1, 1, 2, 5, 5, 1, 1, 1, 4, 0),
      geom(1, 2, 3, 1, 3, 3, 1, 1, 1, 1),
  };
  for (size_t gi = 0; gi < sizeof geoms / sizeof geoms[0]; gi++) {
    const ac_conv2d_geom *g = &geoms[gi];
    size_t oh, ow;
    OK(ac_conv2d_out_hw(g, &oh, &ow));
    size_t nx = g->n * g->c * g->h * g->w, rows = g->n * g->c * g->kh * g->kw;
    size_t ncol = rows * oh * ow;
    float *hx = host_rand(nx), *hc = host_rand(ncol);
    float *want = host_zeros(ncol);
    double *wantx = dzeros(nx);
    for (int merged = 0; merged < 2; merged++) {
      memset(want, 0, ncol * sizeof *want);
      memset(wantx, 0, nx * sizeof *wantx);
      for (size_t r = 0; r < rows; r++) {
        size_t q = r % g->kw, p = r / g->kw % g->kh, plane = r / (g->kh * g->kw);
        /* ac_im2col: rows (b, ch, p, q); ac_im2col_batch: row (ch, p, q), column (b, y, x) */
        size_t b = plane / g->c, crow = r % (g->c * g->kh * g->kw);
        for (size_t y = 0; y < oh; y++)
          for (size_t xo = 0; xo < ow; xo++) {
            long iy = (long)(y * g->stride_h + p) - (long)g->pad_h;
            long ix = (long)(xo * g->stride_w + q) - (long)g->pad_w;
            size_t o =
                merged ? crow * g->n * oh * ow + (b * oh + y) * ow + xo : (r * oh + y) * ow + xo;
            if (iy < 0 || ix < 0 || iy >= (long)g->h || ix >= (long)g->w) continue;
            size_t i = (plane * g->h + (size_t)iy) * g->w + (size_t)ix;
            want[o] = hx[i];
            wantx[i] += hc[o];
          }
      }
      float *x = dev_up(be, hx, nx), *c = dev_up(be, hc, ncol);
      float *col = dev_alloc(be, ncol * sizeof(float)), *dx = dev_alloc(be, nx * sizeof(float));
      OK(merged ? ac_im2col_batch(be, g, x, col) : ac_im2col(be, g, x, col));
      OK(merged ? ac_col2im_batch(be, g, c, dx) : ac_col2im(be, g, c, dx));
      float *got = dev_down(be, col, ncol), *gotx = dev_down(be, dx, nx);
      assert_memory_equal(got, want, ncol * sizeof(float)); /* a copy: exact */
      expect_close("col2im", gotx, wantx, nx, 1e-6, 1e-6);
      free(got);
      free(gotx);
      ac_free(be, x);
      ac_free(be, c);
      ac_free(be, col);
      ac_free(be, dx);
    }
    free(hx);
    free(hc);
    free(want);
    free(wantx);
  }
}

/* The direct 3x3 convs on 2 threads give the bits of 1 thread: the forward split by
 * images, the weight gradient by blocks of weights, over several chunks of images; syrk by
 * blocks of rows; and the permutes split by rows (a conv's (oc, n, ohw) -> (n, oc, ohw), and one that moves the
 * last axis), checked against 1 thread and the index formula. */
static void conv3x3_bitwise(int isa) {
  ac_backend *be[2] = {NULL, NULL};
  cpu_pair_isa(be, isa);
  int direct = ac_conv3x3_supported(be[0], 16, 16);
  if (!direct) print_message("conv3x3: no direct kernels on %s\n", ac_backend_describe(be[0]));
  const size_t n = 21, c = 16, h = 28, w = 28, nx = n * c * h * w, nw = c * c * 9;
  const size_t ns = 300 * 301 / 2;
  float *hx = host_rand(nx), *hdy = host_rand(nx), *hwt = host_rand(nw);
  float *out[2] = {NULL, NULL}, *s2[2] = {NULL, NULL};
  for (int t = 0; t < 2; t++) {
    ac_backend *b = be[t];
    float *x = dev_up(b, hx, nx), *dy = dev_up(b, hdy, nx), *wt = dev_up(b, hwt, nw);
    float *r = dev_alloc(b, (3 * nx + nw + ns) * sizeof(float));
    OK(ac_fill_f32(b, nx + nw, r, 0.0f));
    if (direct) {
      OK(ac_conv3x3(b, n, c, c, h, w, x, wt, r));
      OK(ac_conv3x3_wgrad(b, n, c, c, h, w, x, dy, r + nx));
    }
    if (direct) { /* stride 2: 16 -> 16 channels, y and dy of a quarter of the plane */
      s2[t] = dev_alloc(b, (nx / 4 + nw + nx) * sizeof(float));
      OK(ac_fill_f32(b, nw, s2[t] + nx / 4, 0.0f));
      OK(ac_conv_s2(b, n, c, c, h, w, 3, x, wt, s2[t]));
      OK(ac_conv_s2_wgrad(b, n, c, c, h, w, 3, x, dy, s2[t] + nx / 4));
      OK(ac_conv_s2_dgrad(b, n, c, c, h, w, 3, dy, wt, s2[t] + nx / 4 + nw));
      float *d = dev_down(b, s2[t], nx / 4 + nw + nx);
      ac_free(b, s2[t]);
      s2[t] = d;
    }
    /* syrk: blocks of rows of the triangle, from both ends */
    OK(ac_syrk_packed(b, AC_NO_TRANS, 300, 400, 1.0f, x, 400, 0.0f, r + 3 * nx + nw));
    const size_t shape[3] = {n, c, h * w};
    const int swap[3] = {1, 0, 2}, rot[3] = {2, 0, 1};
    OK(ac_permute(b, 3, shape, swap, x, r + nx + nw));
    OK(ac_permute(b, 3, shape, rot, x, r + 2 * nx + nw));
    out[t] = dev_down(b, r, 3 * nx + nw + ns);
    ac_free(b, x);
    ac_free(b, dy);
    ac_free(b, wt);
    ac_free(b, r);
  }
  assert_memory_equal(out[0], out[1], (3 * nx + nw + ns) * sizeof(float));
  if (direct) assert_memory_equal(s2[0], s2[1], (nx / 4 + nw + nx) * sizeof(float));
  free(s2[0]);
  free(s2[1]);
  const float *sw = out[1] + nx + nw, *rt = sw + nx;
  for (size_t b = 0; b < n; b++)
    for (size_t ch = 0; ch < c; ch++)
      for (size_t i = 0; i < h * w; i++) {
        float v = hx[(b * c + ch) * h * w + i];
        assert_true(sw[(ch * n + b) * h * w + i] == v);
        assert_true(rt[(i * n + b) * c + ch] == v);
      }
  free(out[0]);
  free(out[1]);
  free(hx);
  free(hdy);
  free(hwt);
  ac_backend_destroy(be[0]);
  ac_backend_destroy(be[1]);
}

/* The direct 3x3 conv (stride 1, padding 1) in double loops: want += the conv of x with wt
 * (n, oc, h, w); when dy is not NULL, want_dw += its weight gradient for dy. */
static void conv3x3_loops(size_t n, size_t c, size_t oc, size_t h, size_t w, const float *x,
                          const float *wt, const float *dy, double *want, double *want_dw) {
  for (size_t b = 0; b < n; b++)
    for (size_t o = 0; o < oc; o++)
      for (size_t yy = 0; yy < h; yy++)
        for (size_t xx = 0; xx < w; xx++)
          for (size_t ch = 0; ch < c; ch++)
            for (size_t t = 0; t < 9; t++) {
              long iy = (long)yy + (long)(t / 3) - 1, ix = (long)xx + (long)(t % 3) - 1;
              if (iy < 0 || ix < 0 || iy >= (long)h || ix >= (long)w) continue;
              size_t yi = ((b * oc + o) * h + yy) * w + xx, wi = (o * c + ch) * 9 + t;
              double xv = x[((b * c + ch) * h + (size_t)iy) * w + (size_t)ix];
              want[yi] += (double)wt[wi] * xv;
              if (dy != NULL) want_dw[wi] += (double)dy[yi] * xv;
            }
}

/* The forward 3x3 convs with moments at a ResNet's shapes (stage 1's 16 channels at 28x28,
 * stage 2's 32 at 14x14, stage 3's 64 at 7x7) and odd ones, and the input gradient with
 * batch norm's sums (a residual, a mask): the best variant (on AVX-512F the lanes layout, 16
 * images in a vector, for planes of up to 14x14: conv_lanes.h) gives the bits of the AVX2
 * variant (always the tall layout), y, moments and sums, on 1 and 2 threads, and matches
 * double loops. Batches of 16 images (one group), 17 and 37 (a partial group
 * after full ones), 1 and 5 (a partial group alone). */
static void test_cpu_conv3x3_lanes(void **state) {
  (void)state;
  const size_t shapes[][5] = {{37, 32, 32, 14, 14}, {17, 64, 64, 7, 7},  {16, 64, 64, 7, 7},
                              {1, 64, 64, 7, 7},    {5, 16, 32, 14, 14}, {3, 8, 4, 13, 15},
                              {2, 4, 8, 1, 1},      {2, 16, 16, 28, 28}};
  ac_backend *ref[2] = {NULL, NULL}, *be[2] = {NULL, NULL};
  cpu_pair_isa(ref, AC_CPU_ISA_AVX2);
  cpu_pair_isa(be, AC_CPU_ISA_BEST);
  int direct = ac_conv3x3_supported(ref[0], 4, 4);
  if (!direct)
    print_message("conv3x3 lanes: no direct kernels on %s\n", ac_backend_describe(ref[0]));
  for (size_t s = 0; s < sizeof shapes / sizeof shapes[0] && direct; s++) {
    size_t n = shapes[s][0], c = shapes[s][1], oc = shapes[s][2], h = shapes[s][3];
    size_t w = shapes[s][4], nx = n * c * h * w, ny = n * oc * h * w, nw = oc * c * 9;
    float *hx = host_rand(nx), *hwt = host_rand(nw);
    double *want = dzeros(ny);
    conv3x3_loops(n, c, oc, h, w, hx, hwt, NULL, want, NULL);
    /* Also as an input gradient with batch norm's sums (ac_conv3x3_bn_grad), with a residual
     * and a mask: the result and the sums. */
    float *hres = host_rand(ny), *hmask = host_rand(ny), *hbx = host_rand(ny), *hc = host_rand(oc);
    float *got[4];
    size_t len = 2 * ny + 4 * oc;
    for (int k = 0; k < 4; k++) { /* AVX2 on 1 and 2 threads, then the best */
      ac_backend *b = k < 2 ? ref[k] : be[k - 2];
      float *x = dev_up(b, hx, nx), *wt = dev_up(b, hwt, nw), *res = dev_up(b, hres, ny);
      float *mask = dev_up(b, hmask, ny), *bx = dev_up(b, hbx, ny), *cen = dev_up(b, hc, oc);
      float *y = dev_alloc(b, len * sizeof(float));
      OK(ac_fill_f32(b, len, y, NAN)); /* overwritten */
      OK(ac_conv3x3_moments(b, n, c, oc, h, w, x, wt, y, y + ny));
      ac_bn_grad_args a = {.mask = mask, .x = bx, .center = cen, .sums = y + 2 * ny + 2 * oc};
      OK(ac_conv3x3_bn_grad(b, n, c, oc, h, w, x, wt, res, y + ny + 2 * oc, &a));
      got[k] = dev_down(b, y, len);
      DEV_FREE(b, x, wt, res, mask, bx, cen, y);
    }
    expect_close("conv3x3 lanes", got[2], want, ny, 2e-6 * (double)(c * 9), 1e-5);
    for (size_t i = 0; i < ny; i++) { /* the input gradient: (y + res) masked */
      double g = hmask[i] > 0.0f ? want[i] + hres[i] : 0.0;
      assert_true(fabs(got[2][ny + 2 * oc + i] - g) <= 2e-6 * (double)(c * 9) + 1e-5 * fabs(g));
    }
    for (int k = 1; k < 4; k++) assert_memory_equal(got[0], got[k], len * sizeof(float));
    for (int k = 0; k < 4; k++) free(got[k]);
    free(want);
    HOST_FREE(hx, hwt, hres, hmask, hbx, hc);
  }
  for (int t = 0; t < 2; t++) {
    ac_backend_destroy(ref[t]);
    ac_backend_destroy(be[t]);
  }
}

/* Every variant of the direct kernels (and the portable path's permutes and syrk). */
static void test_cpu_conv3x3_bitwise(void **state) {
  (void)state;
  for (size_t i = 0; i < sizeof conv_isas / sizeof conv_isas[0]; i++) conv3x3_bitwise(conv_isas[i]);
}

/* ac_conv3x3_bn_grad: the input gradient of a stride-1 conv with the batch norm's backward
 * sums made in its copy-out. On every direct variant and 1 and 2 threads it must give the
 * bits of the two-pass recipe (ac_conv3x3 or ac_conv3x3_add, then ac_channel_grad_sums
 * with gout over the result): y masked, the sums; with and without a residual (also in
 * place, res == y) and a mask; planes shorter than a vector (7x7, 1x1, a row of 9), and a
 * 28x28 one. And the sums are the sums: against double loops over the masked gradient. */
static void test_cpu_conv3x3_bn_grad(void **state) {
  (void)state;
  const size_t shapes[][5] = {
      {3, 8, 4, 7, 9}, {5, 16, 16, 7, 7}, {2, 4, 8, 28, 28}, {3, 4, 4, 1, 1}};
  for (size_t si = 0; si < sizeof shapes / sizeof shapes[0]; si++) {
    size_t n = shapes[si][0], c = shapes[si][1], oc = shapes[si][2], h = shapes[si][3];
    size_t w = shapes[si][4], hw = h * w, nx = n * c * hw, ny = n * oc * hw, nw = oc * c * 9;
    float *hx = host_rand(nx), *hwt = host_rand(nw), *hres = host_rand(ny);
    float *hmask = host_rand(ny), *hbx = host_rand(ny), *hc = host_rand(oc);
    for (size_t i = 0; i < ny; i++) {
      hmask[i] -= 0.3f; /* about a third masked out, some exactly 0 (masked) */
      if (i % 11 == 0) hmask[i] = 0.0f;
      hbx[i] = 3.0f * hbx[i] + 2.0f;
    }
    for (size_t v = 1; v < sizeof conv_isas / sizeof conv_isas[0]; v++) {
      ac_backend *be[2] = {NULL, NULL};
      cpu_pair_isa(be, conv_isas[v]);
      if (!ac_conv3x3_supported(be[0], c, oc)) {
        print_message("conv3x3_bn_grad: no direct kernels on %s\n", ac_backend_describe(be[0]));
        ac_backend_destroy(be[0]);
        ac_backend_destroy(be[1]);
        continue;
      }
      float *first = NULL;
      for (int t = 0; t < 2; t++) {
        ac_backend *b = be[t];
        float *x = dev_up(b, hx, nx), *wt = dev_up(b, hwt, nw), *res = dev_up(b, hres, ny);
        float *mask = dev_up(b, hmask, ny), *bx = dev_up(b, hbx, ny), *cen = dev_up(b, hc, oc);
        /* per case: fused y, fused sums, two-pass y, two-pass sums */
        const size_t per = 2 * ny + 4 * oc, ncase = 4;
        float *r = dev_alloc(b, ncase * per * sizeof(float)),
              *tmp = dev_alloc(b, ny * sizeof(float));
        for (size_t k = 0; k < ncase; k++) {
          int with_res = k & 1, with_mask = (k >> 1) & 1;
          float *fy = r + k * per, *fs = fy + ny, *uy = fs + 2 * oc, *us = uy + ny;
          const float *rs = with_res ? res : NULL, *mk = with_mask ? mask : NULL;
          ac_bn_grad_args a = {.mask = mk, .x = bx, .center = cen, .sums = fs};
          OK(ac_conv3x3_bn_grad(b, n, c, oc, h, w, x, wt, rs, fy, &a));
          if (with_res)
            OK(ac_conv3x3_add(b, n, c, oc, h, w, x, wt, res, tmp));
          else
            OK(ac_conv3x3(b, n, c, oc, h, w, x, wt, tmp));
          OK(ac_channel_grad_sums(b, n, oc, hw, tmp, mk, bx, cen, uy, us, us + oc));
        }
        /* in place over the residual: the bits of case 3 (residual and mask) */
        float *ip = dev_up(b, hres, ny), *ips = dev_alloc(b, 2 * oc * sizeof(float));
        ac_bn_grad_args a = {.mask = mask, .x = bx, .center = cen, .sums = ips};
        OK(ac_conv3x3_bn_grad(b, n, c, oc, h, w, x, wt, ip, ip, &a));
        float *got = dev_down(b, r, ncase * per), *gip = dev_down(b, ip, ny);
        float *gips = dev_down(b, ips, 2 * oc);
        for (size_t k = 0; k < ncase; k++) /* fused == two-pass, to the bit */
          assert_memory_equal(got + k * per, got + k * per + ny + 2 * oc,
                              (ny + 2 * oc) * sizeof(float));
        assert_memory_equal(gip, got + 3 * per, ny * sizeof(float));
        assert_memory_equal(gips, got + 3 * per + ny, 2 * oc * sizeof(float));
        /* bad arguments: the sums over y, no batch norm, x and y the same */
        a.sums = ip;
        assert_int_equal(ac_conv3x3_bn_grad(b, n, c, oc, h, w, x, wt, NULL, ip, &a), AC_EINVAL);
        assert_int_equal(ac_conv3x3_bn_grad(b, n, c, oc, h, w, x, wt, NULL, ip, NULL), AC_EINVAL);
        a.sums = ips;
        a.x = ip;
        assert_int_equal(ac_conv3x3_bn_grad(b, n, c, oc, h, w, x, wt, NULL, ip, &a), AC_EINVAL);
        if (t == 0 && v == 1) { /* the sums against double loops over the masked y */
          for (size_t k = 0; k < ncase; k++) {
            const float *gy = got + k * per, *gs = gy + ny;
            for (size_t o = 0; o < oc; o++) {
              double sg = 0.0, sgx = 0.0, mag = 0.0;
              for (size_t bb = 0; bb < n; bb++)
                for (size_t i = 0; i < hw; i++) {
                  size_t at = (bb * oc + o) * hw + i;
                  if ((k >> 1) & 1) assert_true(hmask[at] > 0.0f || gy[at] == 0.0f);
                  sg += gy[at];
                  sgx += (double)gy[at] * ((double)hbx[at] - hc[o]);
                  mag += fabs((double)gy[at] * ((double)hbx[at] - hc[o]));
                }
              assert_true(fabs(gs[o] - sg) <= 1e-5 * (1.0 + mag));
              assert_true(fabs(gs[oc + o] - sgx) <= 1e-5 * (1.0 + mag));
            }
          }
        }
        if (first == NULL) {
          first = got;
        } else { /* 2 threads: the bits of 1 */
          assert_memory_equal(first, got, ncase * per * sizeof(float));
          free(got);
        }
        free(gip);
        free(gips);
        DEV_FREE(b, x, wt, res, mask, bx, cen, r, tmp, ip, ips);
      }
      free(first);
      ac_backend_destroy(be[0]);
      ac_backend_destroy(be[1]);
    }
    HOST_FREE(hx, hwt, hres, hmask, hbx, hc);
  }
}

/* ac_conv_s2_dgrad_bn: the stride-2 input gradient plus a residual, masked, with the batch
 * norm's sums, the bits of ac_conv_s2_dgrad, ac_axpby and ac_channel_grad_sums, on 1 and 2
 * threads, 3x3 and 1x1 (odd pixels only the residual's); a residual over dx is AC_EINVAL. */
static void test_cpu_conv_s2_dgrad_bn(void **state) {
  (void)state;
  const size_t shapes[][6] = {{3, 8, 4, 14, 14, 3}, {2, 4, 8, 6, 8, 1}, {5, 16, 16, 14, 14, 3}};
  for (size_t si = 0; si < sizeof shapes / sizeof shapes[0]; si++) {
    size_t n = shapes[si][0], c = shapes[si][1], oc = shapes[si][2], h = shapes[si][3];
    size_t w = shapes[si][4], k = shapes[si][5], hw = h * w, nx = n * c * hw;
    size_t ny = n * oc * hw / 4, nw = oc * c * k * k;
    float *hdy = host_rand(ny), *hwt = host_rand(nw), *hres = host_rand(nx);
    float *hmask = host_rand(nx), *hbx = host_rand(nx), *hc = host_rand(c);
    for (size_t i = 0; i < nx; i++) hmask[i] -= 0.3f;
    ac_backend *be[2] = {NULL, NULL};
    cpu_pair(be);
    float *first = NULL;
    for (int t = 0; t < 2 && ac_conv_s2_supported(be[0], c, oc, h, w, k); t++) {
      ac_backend *b = be[t];
      float *dy = dev_up(b, hdy, ny), *wt = dev_up(b, hwt, nw), *res = dev_up(b, hres, nx);
      float *mask = dev_up(b, hmask, nx), *bx = dev_up(b, hbx, nx), *cen = dev_up(b, hc, c);
      float *r = dev_alloc(b, (3 * nx + 4 * c) * sizeof(float)), *fs = r + 3 * nx;
      ac_bn_grad_args a = {.mask = mask, .x = bx, .center = cen, .sums = fs};
      OK(ac_conv_s2_dgrad_bn(b, n, c, oc, h, w, k, dy, wt, res, r, &a));
      OK(ac_conv_s2_dgrad(b, n, c, oc, h, w, k, dy, wt, r + nx));
      OK(ac_axpby(b, nx, 1.0f, r + nx, 1.0f, res, r + nx));
      OK(ac_channel_grad_sums(b, n, c, hw, r + nx, mask, bx, cen, r + 2 * nx, fs + 2 * c,
                              fs + 3 * c));
      assert_int_equal(ac_conv_s2_dgrad_bn(b, n, c, oc, h, w, k, dy, wt, r, r, &a), AC_EINVAL);
      float *got = dev_down(b, r, 3 * nx + 4 * c);
      assert_memory_equal(got, got + 2 * nx, nx * sizeof(float)); /* dx masked */
      assert_memory_equal(got + 3 * nx, got + 3 * nx + 2 * c, 2 * c * sizeof(float));
      if (first == NULL) {
        first = got;
      } else {
        assert_memory_equal(first, got, (3 * nx + 4 * c) * sizeof(float));
        free(got);
      }
      DEV_FREE(b, dy, wt, res, mask, bx, cen, r);
    }
    free(first);
    ac_backend_destroy(be[0]);
    ac_backend_destroy(be[1]);
    HOST_FREE(hdy, hwt, hres, hmask, hbx, hc);
  }
}

static void test_conv_im2col(void **state) {
  ac_backend *be = backend(state);
  const ac_conv2d_geom g = geom(2, 3, 9, 7, 3, 2, 2, 1, 1, 1);
  size_t oh, ow;
  OK(ac_conv2d_out_hw(&g, &oh, &ow));
  assert_int_equal(oh, 5); /* (9 + 2 - 3) / 2 + 1 */
  assert_int_equal(ow, 8); /* (7 + 2 - 2) / 1 + 1 */
  const size_t oc = 4, ckk = g.c * g.kh * g.kw, ohw = oh * ow;
  const size_t nx = g.n * g.c * g.h * g.w, ncol = g.n * ckk * ohw, ny = g.n * oc * ohw;
  float *hx = host_rand(nx), *hw = host_rand(oc * ckk);
  float *x = dev_up(be, hx, nx), *w = dev_up(be, hw, oc * ckk);
  float *col = dev_alloc(be, ncol * sizeof(float)), *y = dev_alloc(be, ny * sizeof(float));
  float *t = dev_alloc(be, ny * sizeof(float));

  /* Conv forward by both recipes of accel.h against a direct loop: im2col + batched gemm,
   * and im2col_batch + one gemm over the batch + permute to NCHW. */
  const size_t tshape[3] = {oc, g.n, ohw};
  const int swap[3] = {1, 0, 2};
  OK(ac_im2col_batch(be, &g, x, col));
  OK(ac_sgemm(be, AC_NO_TRANS, AC_NO_TRANS, oc, g.n * ohw, ckk, 1.0f, w, ckk, col, g.n * ohw, 0.0f,
              t, g.n * ohw));
  OK(ac_permute(be, 3, tshape, swap, t, y));
  float *got_batch = dev_down(be, y, ny);
  OK(ac_im2col(be, &g, x, col));
  OK(ac_sgemm_batched(be, AC_NO_TRANS, AC_NO_TRANS, oc, ohw, ckk, 1.0f, w, ckk, 0, col, ohw,
                      ckk * ohw, 0.0f, y, ohw, oc * ohw, g.n));
  float *got = dev_down(be, y, ny);
  double *want = dzeros(ny);
  for (size_t b = 0; b < g.n; b++)
    for (size_t o = 0; o < oc; o++)
      for (size_t yy = 0; yy < oh; yy++)
        for (size_t xx = 0; xx < ow; xx++) {
          double s = 0;
          for (size_t ch = 0; ch < g.c; ch++)
            for (size_t p = 0; p < g.kh; p++)
              for (size_t q = 0; q < g.kw; q++) {
                long iy = (long)(yy * g.stride_h + p) - (long)g.pad_h;
                long ix = (long)(xx * g.stride_w + q) - (long)g.pad_w;
                if (iy < 0 || ix < 0 || iy >= (long)g.h || ix >= (long)g.w) continue;
                s += (double)hw[o * ckk + (ch * g.kh + p) * g.kw + q] *
                     hx[((b * g.c + ch) * g.h + (size_t)iy) * g.w + (size_t)ix];
              }
          want[((b * oc + o) * oh + yy) * ow + xx] = s;
        }
  expect_close("conv via im2col", got, want, ny, 1e-5, 1e-5);
  expect_close("conv via im2col_batch", got_batch, want, ny, 1e-5, 1e-5);
  free(got);
  free(got_batch);
  free(want);

  /* col2im is the adjoint of im2col: <im2col(x), c> == <x, col2im(c)>. */
  float *hc = host_rand(ncol);
  float *c = dev_up(be, hc, ncol), *xb = dev_alloc(be, nx * sizeof(float));
  OK(ac_fill_f32(be, nx, xb, NAN)); /* overwritten, never read */
  OK(ac_col2im(be, &g, c, xb));
  float *gcol = dev_down(be, col, ncol), *gxb = dev_down(be, xb, nx);
  double lhs = 0, rhs = 0;
  for (size_t i = 0; i < ncol; i++) lhs += (double)gcol[i] * hc[i];
  for (size_t i = 0; i < nx; i++) rhs += (double)hx[i] * gxb[i];
  assert_true(fabs(lhs - rhs) <= 1e-4 * (1 + fabs(lhs)));
  /* And col2im directly: the input (1, 1, 4, 4) interior pixel of a 3x3 stride-1 pad-0 conv
   * is covered by as many windows as overlap it. */
  const ac_conv2d_geom g1 = geom(1, 1, 4, 4, 3, 3, 1, 1, 0, 0);
  float *ones = dev_alloc(be, 9 * 4 * sizeof(float)), *cnt = dev_alloc(be, 16 * sizeof(float));
  OK(ac_fill_f32(be, 36, ones, 1.0f));
  OK(ac_col2im(be, &g1, ones, cnt));
  float *hcnt = dev_down(be, cnt, 16);
  const float expect_cnt[16] = {1, 2, 2, 1, 2, 4, 4, 2, 2, 4, 4, 2, 1, 2, 2, 1};
  assert_memory_equal(hcnt, expect_cnt, sizeof expect_cnt);
  free(hcnt);
  ac_free(be, ones);
  ac_free(be, cnt);

  free(gcol);
  free(gxb);
  free(hc);
  free(hx);
  free(hw);
  ac_free(be, c);
  ac_free(be, xb);
  ac_free(be, x);
  ac_free(be, w);
  ac_free(be, col);
  ac_free(be, y);
  ac_free(be, t);
}

/* The _moments variant of a direct conv (k 3 stride 1: ac_conv3x3; else ac_conv_s2) writes
 * the bits of the plain call's y (in y_ref) and, as the moments, the bits ac_channel_moments
 * gives for that y; a moments buffer aliasing y is AC_EINVAL. ac_conv3x3_add gives y_ref +
 * res to the bit. */
static void check_conv_moments(ac_backend *be, size_t n, size_t c, size_t oc, size_t h, size_t w,
                               size_t k, size_t stride, const float *x, const float *wt,
                               const float *y_ref) {
  size_t ohw = (h / stride) * (w / stride), ny = n * oc * ohw;
  float *y = dev_alloc(be, ny * sizeof(float)), *mom = dev_alloc(be, 4 * oc * sizeof(float));
  if (stride == 1) {
    /* and ac_conv3x3_add: y_ref + res, out of place and in place (res == y) */
    float *res = dev_alloc(be, ny * sizeof(float)), *hres = host_rand(ny);
    float *ref = dev_down(be, y_ref, ny);
    OK(ac_memcpy_h2d(be, res, hres, ny * sizeof(float)));
    OK(ac_conv3x3_add(be, n, c, oc, h, w, x, wt, res, y));
    float *sum = dev_down(be, y, ny);
    OK(ac_conv3x3_add(be, n, c, oc, h, w, x, wt, res, res));
    float *inplace = dev_down(be, res, ny);
    for (size_t i = 0; i < ny; i++) {
      float want = ref[i] + hres[i];
      assert_memory_equal(&sum[i], &want, sizeof want);
      assert_memory_equal(&inplace[i], &want, sizeof want);
    }
    assert_int_equal(ac_conv3x3_add(be, n, c, oc, h, w, x, wt, NULL, y), AC_EINVAL);
    free(sum);
    free(inplace);
    free(ref);
    free(hres);
    ac_free(be, res);
    OK(ac_conv3x3_moments(be, n, c, oc, h, w, x, wt, y, mom));
    assert_int_equal(ac_conv3x3_moments(be, n, c, oc, h, w, x, wt, y, y), AC_EINVAL);
  } else {
    OK(ac_conv_s2_moments(be, n, c, oc, h, w, k, x, wt, y, mom));
    assert_int_equal(ac_conv_s2_moments(be, n, c, oc, h, w, k, x, wt, y, NULL), AC_EINVAL);
  }
  OK(ac_channel_moments(be, n, oc, ohw, y, mom + 2 * oc, mom + 3 * oc));
  float *got = dev_down(be, y, ny), *want = dev_down(be, y_ref, ny);
  float *m = dev_down(be, mom, 4 * oc);
  assert_memory_equal(got, want, ny * sizeof(float));
  assert_memory_equal(m, m + 2 * oc, 2 * oc * sizeof(float));
  free(got);
  free(want);
  free(m);
  ac_free(be, y);
  ac_free(be, mom);
}

/* The direct 3x3 convs (stride 1, padding 1) against double loops: odd sizes (a row of 9,
 * a 7-row image, planes smaller than a vector, 1 input channel, channels not a multiple of
 * 4), the weight gradient added to what dw held. A backend without the kernels (CUDA; a CPU
 * without AVX2 + FMA) answers AC_ENOTSUP, and the layers use im2col + gemm. */
static void conv3x3_against_loops(ac_backend *be) {
  /* An image's vectors of 16 positions ((h + 1)(w + 1) / 16, rounded up): 5, 53, 15, 1, 1,
   * 4, 11, and 7, 8, 2, 13 (the AVX-512F forward's splits of a rest of 7, 8 and 2). */
  const size_t shapes[][5] = {{3, 5, 8, 7, 9},    {2, 1, 16, 28, 28}, {2, 16, 16, 14, 14},
                              {1, 4, 4, 1, 1},    {3, 8, 4, 2, 3},    {2, 3, 8, 7, 7},
                              {1, 2, 12, 11, 13}, {2, 4, 8, 9, 9},    {1, 4, 4, 10, 10},
                              {2, 3, 4, 4, 4},    {1, 2, 8, 12, 15}};
  if (!ac_conv3x3_supported(be, 4, 4)) {
    float z[3] = {0, 0, 0};
    assert_int_equal(ac_conv3x3(be, 1, 4, 4, 1, 1, z, z + 1, z + 2), AC_ENOTSUP);
    ac_bn_grad_args a = {.mask = NULL, .x = z, .center = z, .sums = z + 1};
    assert_int_equal(ac_conv3x3_bn_grad(be, 1, 4, 4, 1, 1, z, z, NULL, z + 2, &a), AC_ENOTSUP);
    print_message("conv3x3: no direct kernels on %s\n", ac_backend_describe(be));
    return;
  }
  assert_false(ac_conv3x3_supported(be, 4, 6)); /* output channels in blocks of 4 */
  for (size_t s = 0; s < sizeof shapes / sizeof shapes[0]; s++) {
    size_t n = shapes[s][0], c = shapes[s][1], oc = shapes[s][2], h = shapes[s][3];
    size_t w = shapes[s][4], nx = n * c * h * w, ny = n * oc * h * w, nw = oc * c * 9;
    float *hx = host_rand(nx), *hwt = host_rand(nw), *hdy = host_rand(ny), *hdw = host_rand(nw);
    double *want = dzeros(ny), *want_dw = dzeros(nw);
    for (size_t i = 0; i < nw; i++) want_dw[i] = hdw[i];
    conv3x3_loops(n, c, oc, h, w, hx, hwt, hdy, want, want_dw);
    float *x = dev_up(be, hx, nx), *wt = dev_up(be, hwt, nw), *dy = dev_up(be, hdy, ny);
    float *dw = dev_up(be, hdw, nw), *y = dev_alloc(be, ny * sizeof(float));
    OK(ac_fill_f32(be, ny, y, NAN)); /* overwritten */
    OK(ac_conv3x3(be, n, c, oc, h, w, x, wt, y));
    check_conv_moments(be, n, c, oc, h, w, 3, 1, x, wt, y);
    OK(ac_conv3x3_wgrad(be, n, c, oc, h, w, x, dy, dw));
    float *got = dev_down(be, y, ny), *got_dw = dev_down(be, dw, nw);
    expect_close("conv3x3", got, want, ny, 2e-6 * (double)(c * 9), 1e-5);
    expect_close("conv3x3 wgrad", got_dw, want_dw, nw, 2e-6 * (double)(n * h * w), 1e-5);
    free(got);
    free(got_dw);
    free(want);
    free(want_dw);
    free(hx);
    free(hwt);
    free(hdy);
    free(hdw);
    ac_free(be, x);
    ac_free(be, wt);
    ac_free(be, dy);
    ac_free(be, dw);
    ac_free(be, y);
  }
  float z[4] = {0, 0, 0, 0};
  assert_int_equal(ac_conv3x3(be, 1, 4, 4, 1, 1, z, z + 1, z), AC_EINVAL); /* y aliases x */
  assert_int_equal(ac_conv3x3(be, 1, 4, 4, 1, 1, NULL, z + 1, z + 2), AC_EINVAL);
  assert_int_equal(ac_conv3x3_wgrad(be, 1, 4, 4, 1, 1, z, z, z + 2), AC_EINVAL); /* dy == x */
  assert_int_equal(ac_conv3x3(be, 0, 4, 4, 1, 1, NULL, NULL, NULL), AC_OK);      /* nothing */
}

/* The direct stride-2 convs (3x3 padding 1, 1x1 no padding) against double loops: forward,
 * the weight gradient added to what dw held and the input gradient (overwritten: every
 * pixel, the odd ones of a 1x1 conv included); sizes that take every block path (28x28 ->
 * 14x14, 6 x 10, 2 x 2), 4-32 channels. Unsupported shapes answer AC_ENOTSUP. */
static void conv_s2_against_loops(ac_backend *be) {
  const size_t shapes[][6] = {{3, 4, 8, 28, 28, 3},  {2, 8, 4, 14, 14, 3}, {3, 4, 4, 6, 10, 3},
                              {2, 4, 8, 2, 2, 3},    {3, 4, 8, 28, 28, 1}, {2, 8, 12, 6, 10, 1},
                              {2, 32, 16, 14, 14, 3}};
  if (!ac_conv_s2_supported(be, 4, 4, 2, 2, 3)) {
    float z[3] = {0, 0, 0};
    assert_int_equal(ac_conv_s2(be, 1, 4, 4, 2, 2, 3, z, z + 1, z + 2), AC_ENOTSUP);
    print_message("conv_s2: no direct kernels on %s\n", ac_backend_describe(be));
    return;
  }
  assert_false(ac_conv_s2_supported(be, 4, 4, 3, 2, 3)); /* odd height */
  assert_false(ac_conv_s2_supported(be, 6, 4, 2, 2, 3)); /* input channels in blocks of 4 */
  assert_false(ac_conv_s2_supported(be, 4, 4, 2, 2, 5));
  for (size_t s = 0; s < sizeof shapes / sizeof shapes[0]; s++) {
    size_t n = shapes[s][0], c = shapes[s][1], oc = shapes[s][2], h = shapes[s][3];
    size_t w = shapes[s][4], k = shapes[s][5], pad = k / 2, oh = h / 2, ow = w / 2, kk = k * k;
    size_t nx = n * c * h * w, ny = n * oc * oh * ow, nw = oc * c * kk;
    float *hx = host_rand(nx), *hwt = host_rand(nw), *hdy = host_rand(ny), *hdw = host_rand(nw);
    double *want = dzeros(ny), *want_dw = dzeros(nw), *want_dx = dzeros(nx);
    for (size_t i = 0; i < nw; i++) want_dw[i] = hdw[i];
    for (size_t b = 0; b < n; b++)
      for (size_t o = 0; o < oc; o++)
        for (size_t yy = 0; yy < oh; yy++)
          for (size_t xx = 0; xx < ow; xx++)
            for (size_t ch = 0; ch < c; ch++)
              for (size_t t = 0; t < kk; t++) {
                long iy = 2 * (long)yy + (long)(t / k) - (long)pad;
                long ix = 2 * (long)xx + (long)(t % k) - (long)pad;
                if (iy < 0 || ix < 0 || iy >= (long)h || ix >= (long)w) continue;
                size_t yi = ((b * oc + o) * oh + yy) * ow + xx, wi = (o * c + ch) * kk + t;
                size_t xi = ((b * c + ch) * h + (size_t)iy) * w + (size_t)ix;
                want[yi] += (double)hwt[wi] * hx[xi];
                want_dw[wi] += (double)hdy[yi] * hx[xi];
                want_dx[xi] += (double)hdy[yi] * hwt[wi];
              }
    float *x = dev_up(be, hx, nx), *wt = dev_up(be, hwt, nw), *dy = dev_up(be, hdy, ny);
    float *dw = dev_up(be, hdw, nw), *y = dev_alloc(be, ny * sizeof(float));
    float *dx = dev_alloc(be, nx * sizeof(float));
    OK(ac_fill_f32(be, ny, y, NAN)); /* overwritten */
    OK(ac_fill_f32(be, nx, dx, NAN));
    OK(ac_conv_s2(be, n, c, oc, h, w, k, x, wt, y));
    check_conv_moments(be, n, c, oc, h, w, k, 2, x, wt, y);
    OK(ac_conv_s2_wgrad(be, n, c, oc, h, w, k, x, dy, dw));
    OK(ac_conv_s2_dgrad(be, n, c, oc, h, w, k, dy, wt, dx));
    float *got = dev_down(be, y, ny), *got_dw = dev_down(be, dw, nw),
          *got_dx = dev_down(be, dx, nx);
    expect_close("conv_s2", got, want, ny, 2e-6 * (double)(c * kk), 1e-5);
    expect_close("conv_s2 wgrad", got_dw, want_dw, nw, 2e-6 * (double)(n * oh * ow), 1e-5);
    expect_close("conv_s2 dgrad", got_dx, want_dx, nx, 2e-6 * (double)(oc * kk), 1e-5);
    free(got);
    free(got_dw);
    free(got_dx);
    free(want);
    free(want_dw);
    free(want_dx);
    free(hx);
    free(hwt);
    free(hdy);
    free(hdw);
    ac_free(be, x);
    ac_free(be, wt);
    ac_free(be, dy);
    ac_free(be, dw);
    ac_free(be, y);
    ac_free(be, dx);
  }
  float z[4] = {0, 0, 0, 0};
  assert_int_equal(ac_conv_s2(be, 1, 4, 4, 2, 2, 3, z, z + 1, z), AC_EINVAL); /* y aliases x */
  assert_int_equal(ac_conv_s2_dgrad(be, 1, 4, 4, 2, 2, 3, NULL, z + 1, z + 2), AC_EINVAL);
  assert_int_equal(ac_conv_s2_wgrad(be, 1, 4, 4, 2, 2, 3, z, z, z + 2), AC_EINVAL); /* dy == x */
  assert_int_equal(ac_conv_s2(be, 0, 4, 4, 2, 2, 3, NULL, NULL, NULL), AC_OK);      /* nothing */
}

/* The group's backend, then on the CPU every variant: the portable cap has no direct
 * kernels; AVX2 and AVX-512F (where the processor has them) against the double loops. */
static void test_conv3x3(void **state) {
  ac_backend *be = backend(state);
  conv3x3_against_loops(be);
  conv_s2_against_loops(be);
  if (ac_backend_kind_of(be) != AC_BACKEND_CPU) return;
  for (size_t i = 0; i < sizeof conv_isas / sizeof conv_isas[0]; i++) {
    ac_backend_opts opts;
    ac_backend *v = NULL;
    ac_backend_opts_default(&opts);
    opts.cpu_isa = conv_isas[i];
    OK(ac_backend_create(&v, &opts));
    const char *desc = ac_backend_describe(v);
    if (conv_isas[i] == AC_CPU_ISA_PORTABLE) {
      assert_false(ac_conv3x3_supported(v, 16, 16));
      assert_false(ac_conv_s2_supported(v, 16, 16, 28, 28, 3));
      assert_non_null(strstr(desc, "direct convs none"));
    } else if (strstr(desc, conv_isas[i] == AC_CPU_ISA_AVX2 ? "AVX2" : "AVX-512F") == NULL) {
      print_message("conv3x3: variant %d not run by this processor (%s)\n", conv_isas[i], desc);
    }
    conv3x3_against_loops(v);
    conv_s2_against_loops(v);
    ac_backend_destroy(v);
  }
}

/* Batch norm's per-channel passes against double loops, over a row shape, rows longer than
 * the CPU kernel's 1024-value blocks, and inner 1: moments of data with a mean far from 0,
 * the affine map with and without the residual and the ReLU, the masked gradient sums
 * (with and without gout) and the combine (with a mask and b, c; without, b, c NULL). */
static void test_channel_ops(void **state) {
  ac_backend *be = backend(state);
  const size_t shapes[][3] = {{3, 5, 37}, {2, 3, 1100}, {4, 6, 1}};
  for (size_t si = 0; si < sizeof shapes / sizeof shapes[0]; si++) {
    size_t outer = shapes[si][0], mid = shapes[si][1], inner = shapes[si][2];
    size_t n = outer * mid * inner;
    float *hx = host_rand(n), *hdy = host_rand(n), *hmask = host_rand(n), *hres = host_rand(n);
    float *hp = host_rand(6 * mid); /* scale, shift, center, a, b, c */
    for (size_t i = 0; i < n; i++) hx[i] = 3.0f * hx[i] + 5.0f;
    float *x = dev_up(be, hx, n), *dy = dev_up(be, hdy, n), *mask = dev_up(be, hmask, n);
    float *res = dev_up(be, hres, n), *p = dev_up(be, hp, 6 * mid);
    float *st = dev_alloc(be, 4 * mid * sizeof(float)), *y = dev_alloc(be, n * sizeof(float));
    float *g = dev_alloc(be, n * sizeof(float));
    double *want = dzeros(n), *wst = dzeros(4 * mid);
    const float *sc = hp, *sh = hp + mid, *ce = hp + 2 * mid, *ca = hp + 3 * mid;
    const float *cb = hp + 4 * mid, *cc = hp + 5 * mid;
#define AT(o, m, i) (((o)*mid + (m)) * inner + (i))

    OK(ac_channel_moments(be, outer, mid, inner, x, st, st + mid));
    for (size_t m = 0; m < mid; m++) {
      double s = 0, q = 0, cnt = (double)(outer * inner);
      for (size_t o = 0; o < outer; o++)
        for (size_t i = 0; i < inner; i++) s += hx[AT(o, m, i)];
      for (size_t o = 0; o < outer; o++)
        for (size_t i = 0; i < inner; i++)
          q += (hx[AT(o, m, i)] - s / cnt) * (hx[AT(o, m, i)] - s / cnt);
      wst[m] = s / cnt;
      wst[mid + m] = q / cnt;
    }
    float *got = dev_down(be, st, 2 * mid);
    expect_close("channel mean", got, wst, mid, 1e-6, 1e-6);
    expect_close("channel var", got + mid, wst + mid, mid, 1e-6, 1e-5);
    free(got);

    for (int relu = 0; relu < 2; relu++)
      for (int with_res = 0; with_res < 2; with_res++) {
        OK(ac_channel_affine(be, outer, mid, inner, x, p, p + mid, with_res ? res : NULL, relu, y));
        for (size_t e = 0; e < n; e++) {
          size_t m = e / inner % mid;
          double v = (double)hx[e] * sc[m] + sh[m] + (with_res ? hres[e] : 0.0);
          want[e] = relu && v < 0 ? 0.0 : v;
        }
        got = dev_down(be, y, n);
        expect_close("channel affine", got, want, n, 1e-5, 1e-5);
        free(got);
      }

    for (int masked = 0; masked < 2; masked++) {
      OK(ac_channel_grad_sums(be, outer, mid, inner, dy, masked ? mask : NULL, x, p + 2 * mid,
                              masked ? g : NULL, st + 2 * mid, st + 3 * mid));
      for (size_t m = 0; m < mid; m++) {
        double s = 0, sx = 0;
        for (size_t o = 0; o < outer; o++)
          for (size_t i = 0; i < inner; i++) {
            size_t e = AT(o, m, i);
            double gv = masked && !(hmask[e] > 0) ? 0.0 : hdy[e];
            s += gv;
            sx += gv * ((double)hx[e] - ce[m]);
          }
        wst[2 * mid + m] = s;
        wst[3 * mid + m] = sx;
      }
      got = dev_down(be, st, 4 * mid);
      expect_close("channel sum g", got + 2 * mid, wst + 2 * mid, mid, 1e-5, 1e-5);
      expect_close("channel sum g x", got + 3 * mid, wst + 3 * mid, mid, 1e-4, 1e-5);
      free(got);
    }
    float *gg = dev_down(be, g, n); /* the masked gradient written by the last call: exact */
    for (size_t e = 0; e < n; e++) assert_true(gg[e] == (hmask[e] > 0 ? hdy[e] : 0.0f));
    free(gg);

    for (int full = 0; full < 2; full++) {
      OK(ac_channel_combine(be, outer, mid, inner, dy, full ? mask : NULL, x, p + 3 * mid,
                            full ? p + 4 * mid : NULL, full ? p + 5 * mid : NULL, y));
      for (size_t e = 0; e < n; e++) {
        size_t m = e / inner % mid;
        double gv = full && !(hmask[e] > 0) ? 0.0 : hdy[e];
        want[e] = ca[m] * gv + (full ? (double)cb[m] * hx[e] + cc[m] : 0.0);
      }
      got = dev_down(be, y, n);
      expect_close("channel combine", got, want, n, 1e-5, 1e-5);
      free(got);
    }
#undef AT
    free(hx);
    free(hdy);
    free(hmask);
    free(hres);
    free(hp);
    free(want);
    free(wst);
    ac_free(be, x);
    ac_free(be, dy);
    ac_free(be, mask);
    ac_free(be, res);
    ac_free(be, p);
    ac_free(be, st);
    ac_free(be, y);
    ac_free(be, g);
  }
}

static void test_pool(void **state) {
  ac_backend *be = backend(state);
  const ac_conv2d_geom g = geom(2, 3, 8, 7, 3, 3, 2, 2, 1, 1);
  size_t oh, ow;
  OK(ac_conv2d_out_hw(&g, &oh, &ow));
  const size_t planes = g.n * g.c, nx = planes * g.h * g.w, ny = planes * oh * ow;
  float *hx = host_rand(nx), *hdy = host_rand(ny);
  for (size_t i = 0; i < nx; i++)
    hx[i] -= 2.0f; /* all negative: padding (0) must never win a max */
  float *x = dev_up(be, hx, nx), *y = dev_alloc(be, ny * sizeof(float));
  float *dy = dev_up(be, hdy, ny), *dx = dev_alloc(be, nx * sizeof(float));
  int32_t *am = dev_alloc(be, ny * sizeof(int32_t));

  for (int op = AC_POOL_MAX; op <= AC_POOL_AVG; op++) {
    OK(ac_pool2d_forward(be, (ac_pool_op)op, &g, x, y, am));
    OK(ac_pool2d_backward(be, (ac_pool_op)op, &g, dy, am, dx));
    float *gy = dev_down(be, y, ny), *gdx = dev_down(be, dx, nx);
    double *wy = dzeros(ny), *wdx = dzeros(nx);
    for (size_t pl = 0; pl < planes; pl++)
      for (size_t yy = 0; yy < oh; yy++)
        for (size_t xx = 0; xx < ow; xx++) {
          double best = -INFINITY, sum = 0;
          size_t besti = 0;
          for (size_t p = 0; p < g.kh; p++)
            for (size_t q = 0; q < g.kw; q++) {
              long iy = (long)(yy * g.stride_h + p) - (long)g.pad_h;
              long ix = (long)(xx * g.stride_w + q) - (long)g.pad_w;
              if (iy < 0 || ix < 0 || iy >= (long)g.h || ix >= (long)g.w) continue;
              size_t at = (size_t)iy * g.w + (size_t)ix;
              double v = hx[pl * g.h * g.w + at];
              sum += v;
              if (v > best) {
                best = v;
                besti = at;
              }
            }
          size_t o = (pl * oh + yy) * ow + xx;
          wy[o] = op == AC_POOL_MAX ? best : sum / (double)(g.kh * g.kw);
          if (op == AC_POOL_MAX) {
            wdx[pl * g.h * g.w + besti] += hdy[o];
          } else {
            for (size_t p = 0; p < g.kh; p++)
              for (size_t q = 0; q < g.kw; q++) {
                long iy = (long)(yy * g.stride_h + p) - (long)g.pad_h;
                long ix = (long)(xx * g.stride_w + q) - (long)g.pad_w;
                if (iy >= 0 && ix >= 0 && iy < (long)g.h && ix < (long)g.w)
                  wdx[pl * g.h * g.w + (size_t)iy * g.w + (size_t)ix] +=
                      hdy[o] / (double)(g.kh * g.kw);
              }
          }
        }
    expect_close(op == AC_POOL_MAX ? "maxpool" : "avgpool", gy, wy, ny, 1e-6, 1e-6);
    expect_close(op == AC_POOL_MAX ? "maxpool backward" : "avgpool backward", gdx, wdx, nx, 1e-6,
                 1e-5);
    free(gy);
    free(gdx);
    free(wy);
    free(wdx);
  }
  /* Global average pooling is a reduce. */
  float *gap = dev_alloc(be, planes * sizeof(float));
  OK(ac_reduce(be, AC_REDUCE_SUM, 1, planes, g.h * g.w, 1.0f / (float)(g.h * g.w), x, 0.0f, gap));
  float *gg = dev_down(be, gap, planes);
  for (size_t pl = 0; pl < planes; pl++) {
    double s = 0;
    for (size_t i = 0; i < g.h * g.w; i++) s += hx[pl * g.h * g.w + i];
    assert_true(fabs(gg[pl] - s / (double)(g.h * g.w)) < 1e-5);
  }
  free(gg);
  ac_free(be, gap);
  free(hx);
  free(hdy);
  ac_free(be, x);
  ac_free(be, y);
  ac_free(be, dy);
  ac_free(be, dx);
  ac_free(be, am);
}

/* ------------------------------------------------------------------------------------ */
/* Random numbers                                                                          */

/* The stream as accel.h defines it, written out again here. */
static uint64_t ref_mix(uint64_t seed, uint64_t c) {
  uint64_t z = seed + (c + 1) * 0x9E3779B97F4A7C15ull;
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

static void test_random(void **state) {
  ac_backend *be = backend(state);
  const size_t n = 200000;
  const uint64_t seed = 0xC0FFEEull, offset = 12345;
  float *o = dev_alloc(be, n * sizeof(float));

  /* Uniforms are bit-exact against the definition. */
  OK(ac_rand_uniform(be, seed, offset, n, -2.0f, 3.0f, o));
  float *u = dev_down(be, o, n);
  for (size_t i = 0; i < n; i++) {
    float r = (float)(ref_mix(seed, offset + i) >> 40) * (1.0f / 16777216.0f);
    float want = -2.0f + 5.0f * r;
    if (u[i] != want) {
      print_error("uniform %zu: %.9g != %.9g\n", i, (double)u[i], (double)want);
      fail();
    }
  }
  /* Counter-based: a call at offset + 100 continues the same stream. */
  float *o2 = dev_alloc(be, 50 * sizeof(float));
  OK(ac_rand_uniform(be, seed, offset + 100, 50, -2.0f, 3.0f, o2));
  float *u2 = dev_down(be, o2, 50);
  assert_memory_equal(u2, u + 100, 50 * sizeof(float));
  free(u2);
  ac_free(be, o2);
  free(u);

  /* Normals: the formula to a few ulps, and the moments. */
  OK(ac_rand_normal(be, seed, offset, n, 1.0f, 2.0f, o));
  float *z = dev_down(be, o, n);
  double mean = 0, var = 0;
  for (size_t i = 0; i < n; i++) {
    uint64_t m = ref_mix(seed, offset + i);
    double uu = (double)(m >> 40) / 16777216.0, vv = (double)(m & 0xFFFFFF) / 16777216.0;
    double want = 1.0 + 2.0 * sqrt(-2.0 * log(1.0 - uu)) * cos(2 * M_PI * vv);
    if (!(fabs(z[i] - want) <= 1e-5 * (1 + fabs(want)))) {
      print_error("normal %zu: %.9g != %.9g\n", i, (double)z[i], want);
      fail();
    }
    mean += z[i];
  }
  mean /= (double)n;
  for (size_t i = 0; i < n; i++) var += (z[i] - mean) * (z[i] - mean);
  var /= (double)n;
  assert_true(fabs(mean - 1.0) < 0.02);
  assert_true(fabs(var - 4.0) < 0.08);
  free(z);

  /* Dropout: values 0 or 1/(1-p), the kept fraction near 1-p, exact per element. */
  const float p = 0.3f;
  OK(ac_dropout_mask(be, seed, offset, n, p, o));
  float *mk = dev_down(be, o, n);
  size_t kept = 0;
  for (size_t i = 0; i < n; i++) {
    float r = (float)(ref_mix(seed, offset + i) >> 40) * (1.0f / 16777216.0f);
    float want = r >= p ? 1.0f / (1.0f - p) : 0.0f;
    assert_true(mk[i] == want);
    kept += mk[i] != 0.0f;
  }
  assert_true(fabs((double)kept / (double)n - 0.7) < 0.01);
  free(mk);
  ac_free(be, o);
}

/* ------------------------------------------------------------------------------------ */
/* Fused AdamW                                                                             */

static void test_adamw(void **state) {
  ac_backend *be = backend(state);
  const size_t n = 1025;
  float *hp = host_rand(n), *hg = host_rand(n), *hm = host_rand(n), *hv = host_rand(n);
  for (size_t i = 0; i < n; i++) hv[i] = fabsf(hv[i]) * 0.01f;
  float *p = dev_up(be, hp, n), *g = dev_up(be, hg, n), *m = dev_up(be, hm, n);
  float *v = dev_up(be, hv, n);
  const ac_adamw_args a = {
      .lr = 1e-2f, .beta1 = 0.9f, .beta2 = 0.99f, .eps = 1e-6f, .weight_decay = 0.1f, .step = 3};
  OK(ac_adamw_update(be, n, p, g, m, v, &a));
  float *gp = dev_down(be, p, n), *gm = dev_down(be, m, n), *gv = dev_down(be, v, n);
  double *wp = dzeros(n), *wm = dzeros(n), *wv = dzeros(n);
  for (size_t i = 0; i < n; i++) {
    wm[i] = 0.9 * hm[i] + 0.1 * hg[i];
    wv[i] = 0.99 * hv[i] + 0.01 * (double)hg[i] * hg[i];
    double mh = wm[i] / (1 - pow(0.9, 3)), vh = wv[i] / (1 - pow(0.99, 3));
    wp[i] = hp[i] - 1e-2 * (mh / (sqrt(vh) + 1e-6) + 0.1 * hp[i]);
  }
  expect_close("adamw m", gm, wm, n, 1e-6, 1e-5);
  expect_close("adamw v", gv, wv, n, 1e-8, 1e-5);
  expect_close("adamw p", gp, wp, n, 1e-5, 1e-5);
  free(gp);
  free(gm);
  free(gv);
  free(wp);
  free(wm);
  free(wv);
  free(hp);
  free(hg);
  free(hm);
  free(hv);
  ac_free(be, p);
  ac_free(be, g);
  ac_free(be, m);
  ac_free(be, v);
}

/* Shampoo's fused first moment and graft against the formulas in double, with Nesterov's
 * coefficients (x_g != 0) and without (x_g == 0: x from f alone). */
static void test_moment_graft(void **state) {
  ac_backend *be = backend(state);
  const size_t n = 1031;
  float *hg = host_rand(n), *hf = host_rand(n), *hv = host_rand(n);
  for (size_t i = 0; i < n; i++) hv[i] = fabsf(hv[i]) * 0.01f;
  for (int nesterov = 0; nesterov < 2; nesterov++) {
    const ac_moment_graft_args a = {0.1f,  0.9f, nesterov ? 0.37f : 0.0f, 2.5f, 0.001f, 0.999f,
                                    40.0f, 1e-2f};
    float *g = dev_up(be, hg, n), *f = dev_up(be, hf, n), *v = dev_up(be, hv, n);
    float *x = dev_alloc(be, n * sizeof(float)), *d = dev_alloc(be, n * sizeof(float));
    OK(ac_moment_graft(be, n, g, f, v, x, d, &a));
    double *wf = dzeros(n), *wv = dzeros(n), *wx = dzeros(n), *wd = dzeros(n);
    for (size_t i = 0; i < n; i++) {
      wf[i] = 0.1 * hg[i] + 0.9 * hf[i];
      wx[i] = (nesterov ? 0.37 * hg[i] : 0.0) + 2.5 * wf[i];
      wv[i] = 0.001 * (double)hg[i] * hg[i] + 0.999 * hv[i];
      wd[i] = wx[i] / (sqrt(40.0 * wv[i]) + 1e-2);
    }
    const struct {
      const char *name;
      const float *dev;
      double *want, atol, rtol;
    } out[] = {{"moment_graft f", f, wf, 1e-6, 1e-5},
               {"moment_graft v", v, wv, 1e-9, 1e-5},
               {"moment_graft x", x, wx, 1e-6, 1e-5},
               {"moment_graft d", d, wd, 1e-4, 1e-4}};
    for (size_t k = 0; k < sizeof out / sizeof out[0]; k++) {
      float *got = dev_down(be, out[k].dev, n);
      expect_close(out[k].name, got, out[k].want, n, out[k].atol, out[k].rtol);
      free(got);
      free(out[k].want);
    }
    ac_free(be, g);
    ac_free(be, f);
    ac_free(be, v);
    ac_free(be, x);
    ac_free(be, d);
  }
  free(hg);
  free(hf);
  free(hv);
}

/* ------------------------------------------------------------------------------------ */
/* CUDA against CPU on identical inputs                                                    */
/*                                                                                          */
/* Each scenario runs a chain of primitives on one backend from inputs drawn after a reset */
/* of the host generator, and returns everything it computed (host memory, caller frees). */
/* The same scenario on the CPU and the CUDA backend must agree to the scenario's bound.  */

typedef struct {
  float *data;
  size_t n, cap;
} outbuf;

static void out_take(outbuf *o, ac_backend *be, const float *dev, size_t n) {
  if (o->n + n > o->cap) {
    o->cap = 2 * (o->n + n);
    o->data = realloc(o->data, o->cap * sizeof *o->data);
    assert_non_null(o->data);
  }
  OK(ac_memcpy_d2h(be, o->data + o->n, dev, n * sizeof(float)));
  o->n += n;
}

static void scen_blas(ac_backend *be, outbuf *o) {
  const size_t m = 33, n = 65, k = 47, batch = 4;
  float *ha = host_rand(m * k * batch), *hb = host_rand(k * n * batch);
  float *a = dev_up(be, ha, m * k * batch), *b = dev_up(be, hb, k * n * batch);
  float *c = dev_alloc(be, m * n * batch * sizeof(float));
  for (int t = 0; t < 4; t++) {
    int ta = t & 1, tb = t >> 1;
    OK(ac_sgemm_batched(be, (ac_trans)ta, (ac_trans)tb, m, n, k, 1.5f, a, ta ? m : k, m * k, b,
                        tb ? k : n, k * n, 0.0f, c, n, m * n, batch));
    out_take(o, be, c, m * n * batch);
  }
  float *l = dev_alloc(be, ac_packed_len(m) * sizeof(float));
  float *r = dev_alloc(be, ac_packed_len(k) * sizeof(float));
  OK(ac_fill_f32(be, ac_packed_len(m), l, 1.0f));
  OK(ac_fill_f32(be, ac_packed_len(k), r, 1.0f));
  OK(ac_syrk_packed(be, AC_NO_TRANS, m, k, 0.1f, a, k, 0.9f, l));
  OK(ac_syrk_packed(be, AC_TRANS, k, m, 0.1f, a, k, 0.9f, r));
  out_take(o, be, l, ac_packed_len(m));
  out_take(o, be, r, ac_packed_len(k));
  /* The statistics into host memory (Shampoo's push slots): the CUDA download there. */
  float *hl = malloc(ac_packed_len(m) * sizeof(float));
  assert_non_null(hl);
  OK(ac_syrk_packed_to_host(be, AC_NO_TRANS, m, k, 0.1f, a, k, hl));
  OK(ac_memcpy_h2d(be, l, hl, ac_packed_len(m) * sizeof(float)));
  out_take(o, be, l, ac_packed_len(m));
  free(hl);
  float *dense = dev_alloc(be, k * k * sizeof(float));
  OK(ac_unpack_sym(be, k, r, dense, k));
  out_take(o, be, dense, k * k);
  ac_free(be, dense);
  ac_free(be, l);
  ac_free(be, r);
  ac_free(be, a);
  ac_free(be, b);
  ac_free(be, c);
  free(ha);
  free(hb);
}

/* The CPU backend's GELU uses its own vectorised exp: its stated accuracy, on a dense grid
 * over [-12, 12] and at extremes, against x s(2u) in double (s the logistic function; the
 * same value as 0.5 x (1 + tanh u), without that form's cancellation where GELU is tiny).
 * Forward: relative error under 3e-7 (1 + |2u|), the |2u| part being the rounding of u,
 * amplified by e^(-2u); 1e-36 absolute covers results in the subnormal range. Derivative:
 * 3e-7 absolute. NaN stays NaN. */
static void test_gelu_accuracy(void **state) {
  ac_backend *be = backend(state);
  const float extremes[] = {-1e30f, -1e4f, -100.0f, -30.0f, -9.5f, 0.0f,
                            1e-20f, 30.0f, 100.0f,  1e4f,   1e30f};
  const size_t ngrid = 24001, nx = sizeof extremes / sizeof extremes[0];
  const size_t n = ngrid + nx;
  float *h = host_zeros(n), *ones = host_zeros(n);
  for (size_t i = 0; i < n; i++) {
    h[i] = i < ngrid ? -12.0f + 24.0f * (float)i / (float)(ngrid - 1) : extremes[i - ngrid];
    ones[i] = 1.0f;
  }
  float *x = dev_up(be, h, n), *dy = dev_up(be, ones, n);
  float *y = dev_alloc(be, n * sizeof(float)), *dx = dev_alloc(be, n * sizeof(float));
  OK(ac_unary(be, AC_UNARY_GELU, n, x, y));
  OK(ac_unary_backward(be, AC_UNARY_GELU, n, x, dy, dx));
  float *got = dev_down(be, y, n), *dgot = dev_down(be, dx, n);
  for (size_t i = 0; i < n; i++) {
    double v = h[i], u = sqrt(2 / M_PI) * (v + 0.044715 * v * v * v);
    double s = 1 / (1 + exp(-2 * u));
    double want = v * s;
    double dwant = s + 2 * v * s * (1 - s) * sqrt(2 / M_PI) * (1 + 3 * 0.044715 * v * v);
    if (!isfinite(dwant)) /* huge |x|: the term is 0 * Inf in double too; its limit is 0 */
      dwant = s;
    double tol = 3e-7 * (1 + fabs(2 * u)) * fabs(want) + 1e-36;
    if (!(fabs(got[i] - want) <= tol) || !(fabs(dgot[i] - dwant) <= 3e-7)) {
      print_error("gelu(%.9g) = %.9g, d %.9g; expected %.9g, d %.9g\n", v, (double)got[i],
                  (double)dgot[i], want, dwant);
      fail();
    }
  }
  free(got);
  free(dgot);
  const float nan_in = NAN;
  float nan_out = 0.0f, nan_d = 0.0f;
  OK(ac_memcpy_h2d(be, x, &nan_in, sizeof nan_in));
  OK(ac_unary(be, AC_UNARY_GELU, 1, x, y));
  OK(ac_unary_backward(be, AC_UNARY_GELU, 1, x, dy, dx));
  OK(ac_memcpy_d2h(be, &nan_out, y, sizeof nan_out));
  OK(ac_memcpy_d2h(be, &nan_d, dx, sizeof nan_d));
  assert_true(isnan(nan_out) && isnan(nan_d));
  ac_free(be, x);
  ac_free(be, dy);
  ac_free(be, y);
  ac_free(be, dx);
  free(h);
  free(ones);
}

static void scen_elementwise(ac_backend *be, outbuf *o) {
  const size_t n = 4099;
  float *hx = host_rand(n), *hy = host_rand(n);
  for (size_t i = 0; i < n; i++)
    hy[i] = 0.5f + fabsf(hy[i]); /* positive: every unary op is defined on it */
  float *x = dev_up(be, hx, n), *y = dev_up(be, hy, n), *z = dev_alloc(be, n * sizeof(float));
  for (int op = 0; op < AC_UNARY_COUNT; op++) {
    OK(ac_unary(be, (ac_unary_op)op, n, y, z));
    out_take(o, be, z, n);
    OK(ac_unary_backward(be, (ac_unary_op)op, n, y, x, z));
    out_take(o, be, z, n);
  }
  for (int op = AC_BIN_ADD; op <= AC_BIN_DIV; op++) {
    OK(ac_binary(be, (ac_binary_op)op, n, x, y, z));
    out_take(o, be, z, n);
    OK(ac_bcast(be, (ac_binary_op)op, 3, 1000, 1, x, y, z));
    out_take(o, be, z, 3000);
  }
  OK(ac_axpby(be, n, 0.3f, x, -0.7f, y, z));
  out_take(o, be, z, n);
  for (int op = AC_REDUCE_SUM; op <= AC_REDUCE_NORM2; op++) {
    OK(ac_reduce(be, (ac_reduce_op)op, 4, 10, 100, 1.0f, x, 0.0f, z));
    out_take(o, be, z, 10);
  }
  ac_adamw_args a = {
      .lr = 1e-3f, .beta1 = 0.9f, .beta2 = 0.999f, .eps = 1e-8f, .weight_decay = 0.01f, .step = 5};
  float *m = dev_up(be, hx, n), *v = dev_up(be, hy, n);
  OK(ac_adamw_update(be, n, z, x, m, v, &a));
  out_take(o, be, z, n);
  out_take(o, be, m, n);
  out_take(o, be, v, n);
  const ac_moment_graft_args mg = {0.1f, 0.9f, 0.37f, 2.5f, 0.001f, 0.999f, 40.0f, 1e-6f};
  float *hv = host_rand(n);
  for (size_t i = 0; i < n; i++) hv[i] = fabsf(hv[i]) * 0.01f; /* a second moment: >= 0 */
  float *mv = dev_up(be, hv, n), *mx = dev_alloc(be, n * sizeof(float));
  float *md = dev_alloc(be, n * sizeof(float));
  OK(ac_moment_graft(be, n, y, m, mv, mx, md, &mg));
  out_take(o, be, m, n);
  out_take(o, be, mv, n);
  out_take(o, be, mx, n);
  out_take(o, be, md, n);
  ac_free(be, mv);
  ac_free(be, mx);
  ac_free(be, md);
  free(hv);
  ac_free(be, m);
  ac_free(be, v);
  ac_free(be, x);
  ac_free(be, y);
  ac_free(be, z);
  free(hx);
  free(hy);
}

static void scen_softmax_xent(ac_backend *be, outbuf *o) {
  const size_t batch = 6, t = 40, rows = batch * t, n = rows * t;
  float *hx = host_rand(n);
  int32_t hl[240];
  for (size_t r = 0; r < rows; r++)
    hl[r] = (int32_t)(r * 7 % (t + 3)) - 1; /* some -1 and some >= t: ignored */
  float *x = dev_up(be, hx, n), *y = dev_alloc(be, n * sizeof(float));
  float *loss = dev_alloc(be, rows * sizeof(float));
  int32_t *labels = dev_up_i32(be, hl, rows);
  OK(ac_mask_causal(be, batch, t, x, -INFINITY));
  OK(ac_softmax_rows(be, rows, t, x, y));
  out_take(o, be, y, n);
  OK(ac_softmax_rows_backward(be, rows, t, y, y, x));
  out_take(o, be, x, n);
  OK(ac_memcpy_h2d(be, x, hx, n * sizeof(float)));
  OK(ac_xent_forward(be, rows, t, x, labels, y, loss));
  out_take(o, be, loss, rows);
  OK(ac_xent_backward(be, rows, t, y, labels, 0.5f, y));
  out_take(o, be, y, n);
  /* Layer norm over the same rows (mean and rstd into the loss buffer's neighbours). */
  float *stats = dev_alloc(be, 2 * rows * sizeof(float)),
        *dgb = dev_alloc(be, 2 * t * sizeof(float));
  OK(ac_fill_f32(be, 2 * t, dgb, 0.0f));
  OK(ac_layernorm_rows(be, rows, t, 1e-5f, x, x + n - t, NULL, y, stats, stats + rows));
  out_take(o, be, y, n);
  out_take(o, be, stats, 2 * rows);
  OK(ac_layernorm_rows_backward(be, rows, t, x, x + n - t, stats, stats + rows, y, y, dgb,
                                dgb + t));
  out_take(o, be, y, n);
  out_take(o, be, dgb, 2 * t);
  ac_free(be, stats);
  ac_free(be, dgb);
  ac_free(be, x);
  ac_free(be, y);
  ac_free(be, loss);
  ac_free(be, labels);
  free(hx);
}

static void scen_conv_embed(ac_backend *be, outbuf *o) {
  const ac_conv2d_geom g = geom(3, 4, 11, 10, 3, 3, 2, 2, 1, 2);
  size_t oh, ow;
  OK(ac_conv2d_out_hw(&g, &oh, &ow));
  size_t nx = g.n * g.c * g.h * g.w, ncol = g.n * g.c * 9 * oh * ow, ny = g.n * g.c * oh * ow;
  float *hx = host_rand(nx);
  float *x = dev_up(be, hx, nx), *col = dev_alloc(be, ncol * sizeof(float));
  float *y = dev_alloc(be, ny * sizeof(float)), *dx = dev_alloc(be, nx * sizeof(float));
  int32_t *am = dev_alloc(be, ny * sizeof(int32_t));
  OK(ac_im2col(be, &g, x, col));
  out_take(o, be, col, ncol);
  OK(ac_col2im(be, &g, col, dx));
  out_take(o, be, dx, nx);
  OK(ac_im2col_batch(be, &g, x, col));
  out_take(o, be, col, ncol);
  OK(ac_col2im_batch(be, &g, col, dx));
  out_take(o, be, dx, nx);
  for (int op = AC_POOL_MAX; op <= AC_POOL_AVG; op++) {
    OK(ac_pool2d_forward(be, (ac_pool_op)op, &g, x, y, am));
    out_take(o, be, y, ny);
    OK(ac_pool2d_backward(be, (ac_pool_op)op, &g, y, am, dx));
    out_take(o, be, dx, nx);
  }
  int32_t hi[64];
  for (int r = 0; r < 64; r++) hi[r] = (r * 5) % 23 - 1;
  int32_t *idx = dev_up_i32(be, hi, 64);
  float *e = dev_alloc(be, 64 * 8 * sizeof(float));
  OK(ac_gather_rows(be, 64, 8, x, 20, idx, e));
  out_take(o, be, e, 64 * 8);
  OK(ac_scatter_add_rows(be, 64, 8, e, idx, x, 20));
  out_take(o, be, x, 160);
  const size_t shape[4] = {3, 4, 11, 10};
  const int perm[4] = {1, 3, 0, 2};
  OK(ac_permute(be, 4, shape, perm, x, dx));
  out_take(o, be, dx, nx);
  ac_free(be, idx);
  ac_free(be, e);
  ac_free(be, am);
  ac_free(be, x);
  ac_free(be, col);
  ac_free(be, y);
  ac_free(be, dx);
  free(hx);
}

static void scen_channel(ac_backend *be, outbuf *o) {
  const size_t outer = 4, mid = 7, inner = 45, n = outer * mid * inner;
  float *hx = host_rand(n), *hdy = host_rand(n), *hp = host_rand(6 * mid);
  float *x = dev_up(be, hx, n), *dy = dev_up(be, hdy, n), *p = dev_up(be, hp, 6 * mid);
  float *y = dev_alloc(be, n * sizeof(float)), *g = dev_alloc(be, n * sizeof(float));
  float *dx = dev_alloc(be, n * sizeof(float)), *st = dev_alloc(be, 4 * mid * sizeof(float));
  OK(ac_channel_moments(be, outer, mid, inner, x, st, st + mid));
  OK(ac_channel_affine(be, outer, mid, inner, x, p, p + mid, dy, 1, y));
  OK(ac_channel_grad_sums(be, outer, mid, inner, dy, y, x, st, g, st + 2 * mid, st + 3 * mid));
  OK(ac_channel_combine(be, outer, mid, inner, dy, y, x, p + 3 * mid, p + 4 * mid, p + 5 * mid,
                        dx));
  out_take(o, be, st, 4 * mid);
  out_take(o, be, y, n);
  out_take(o, be, g, n);
  out_take(o, be, dx, n);
  free(hx);
  free(hdy);
  free(hp);
  ac_free(be, x);
  ac_free(be, dy);
  ac_free(be, p);
  ac_free(be, y);
  ac_free(be, g);
  ac_free(be, dx);
  ac_free(be, st);
}

static void scen_random(ac_backend *be, outbuf *o) {
  const size_t n = 10007;
  float *z = dev_alloc(be, n * sizeof(float));
  OK(ac_rand_uniform(be, 99, 1u << 20, n, -1.0f, 1.0f, z));
  out_take(o, be, z, n);
  OK(ac_dropout_mask(be, 99, 7, n, 0.1f, z));
  out_take(o, be, z, n);
  ac_free(be, z);
}

static void scen_normal(ac_backend *be, outbuf *o) {
  const size_t n = 10007;
  float *z = dev_alloc(be, n * sizeof(float));
  OK(ac_rand_normal(be, 99, 3, n, 0.0f, 0.02f, z));
  out_take(o, be, z, n);
  ac_free(be, z);
}

static void test_cuda_matches_cpu(void **state) {
  ac_backend *gpu = backend(state);
  ac_backend *cpu = ((fixture *)*state)->cpu; /* the CUDA group's CPU reference */
  const struct {
    const char *name;
    void (*run)(ac_backend *, outbuf *);
    double atol, rtol;
  } scen[] = {
      {"blas", scen_blas, 1e-4, 1e-5},
      {"elementwise", scen_elementwise, 1e-5, 1e-5},
      {"softmax_xent", scen_softmax_xent, 1e-5, 1e-5},
      {"conv_embed", scen_conv_embed, 1e-5, 1e-5},
      {"channel (batch norm passes)", scen_channel, 1e-4, 1e-5},
      {"random (bit-exact)", scen_random, 0, 0},
      {"normal", scen_normal, 1e-7, 1e-5},
  };
  for (size_t i = 0; i < sizeof scen / sizeof scen[0]; i++) {
    outbuf oc = {0}, og = {0};
    rng_state = 0x5EED5EEDull;
    scen[i].run(cpu, &oc);
    rng_state = 0x5EED5EEDull;
    scen[i].run(gpu, &og);
    assert_int_equal(oc.n, og.n);
    double *want = dzeros(oc.n);
    for (size_t j = 0; j < oc.n; j++) want[j] = oc.data[j];
    expect_close(scen[i].name, og.data, want, og.n, scen[i].atol, scen[i].rtol);
    free(want);
    free(oc.data);
    free(og.data);
  }
}

/* ------------------------------------------------------------------------------------ */
/* Groups                                                                                  */

#define PRIMITIVE_TESTS                                                                     \
  cmocka_unit_test(test_invalid_arguments), cmocka_unit_test(test_memory),                  \
      cmocka_unit_test(test_permute), cmocka_unit_test(test_sgemm),                         \
      cmocka_unit_test(test_sgemm_small_blocks), cmocka_unit_test(test_syrk_small_blocks),  \
      cmocka_unit_test(test_syrk_packed), cmocka_unit_test(test_syrk_packed_to_host),       \
      cmocka_unit_test(test_binary_axpby_affine), cmocka_unit_test(test_unary),             \
      cmocka_unit_test(test_bcast_reduce), cmocka_unit_test(test_scalar_reductions_argmax), \
      cmocka_unit_test(test_softmax_mask), cmocka_unit_test(test_xent),                     \
      cmocka_unit_test(test_layernorm), cmocka_unit_test(test_gather_scatter),              \
      cmocka_unit_test(test_conv_im2col), cmocka_unit_test(test_conv3x3),                   \
      cmocka_unit_test(test_im2col_geometries), cmocka_unit_test(test_pool),                \
      cmocka_unit_test(test_channel_ops), cmocka_unit_test(test_random),                    \
      cmocka_unit_test(test_sample_rows), cmocka_unit_test(test_adamw),                     \
      cmocka_unit_test(test_moment_graft)

int main(void) {
  const struct CMUnitTest lifecycle[] = {cmocka_unit_test(test_strerror_and_create),
                                         cmocka_unit_test(test_cpu_threads),
                                         cmocka_unit_test(test_cpu_pool_bitwise),
                                         cmocka_unit_test(test_cpu_pool_elementwise),
                                         cmocka_unit_test(test_cpu_channel_sums_isa),
                                         cmocka_unit_test(test_cpu_conv3x3_bitwise),
                                         cmocka_unit_test(test_cpu_conv3x3_bn_grad),
                                         cmocka_unit_test(test_cpu_conv_s2_dgrad_bn),
                                         cmocka_unit_test(test_cpu_conv3x3_lanes),
                                         cmocka_unit_test(test_cpu_sgemm_small_vs_openblas)};
  const struct CMUnitTest cpu[] = {PRIMITIVE_TESTS, cmocka_unit_test(test_gelu_accuracy)};
  const struct CMUnitTest cuda[] = {PRIMITIVE_TESTS, cmocka_unit_test(test_cuda_matches_cpu)};
  int failed = cmocka_run_group_tests_name("lifecycle", lifecycle, NULL, NULL);
  failed += cmocka_run_group_tests_name("cpu", cpu, setup_cpu, teardown);
  failed += cmocka_run_group_tests_name("cuda", cuda, setup_cuda, teardown);
  return failed;
}
