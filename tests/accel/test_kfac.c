/* test_kfac.c -- K-FAC's worker kernels (accel/kfac.c) on every backend: dense and conv
 * factors against a brute-force per-sample / per-position computation in double, the
 * batch-norm diagonal against a finite-difference Fisher of a tiny net, the preconditioned
 * update against the host, the KL clip, and one K-FAC step on a linear least-squares
 * problem with the exact model Fisher, which must land on the least-squares solution. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <math.h>

#include <cmocka.h>

#include "accel.h"
#include "test_util.h"

static uint64_t rng = 0x2545F4914F6CDD1Dull;

/* ------------------------------------------------------------------------------------ */
/* Helpers                                                                                */

static float *dev_upload(ac_backend *be, size_t count, const float *host) {
  void *d = NULL;
  OK(ac_malloc(be, (count ? count : 1) * sizeof(float), &d));
  if (count) OK(ac_memcpy_h2d(be, d, host, count * sizeof(float)));
  return d;
}

static float *dev_alloc(ac_backend *be, size_t count) {
  void *d = NULL;
  OK(ac_malloc(be, (count ? count : 1) * sizeof(float), &d));
  return d;
}

static float *host_random(size_t count) {
  float *h = xcalloc(count, sizeof *h);
  for (size_t i = 0; i < count; i++) h[i] = xorshift_frand(&rng);
  return h;
}

static float *download(ac_backend *be, size_t count, const float *d) {
  float *h = xcalloc(count, sizeof *h);
  OK(ac_memcpy_d2h(be, h, d, count * sizeof(float)));
  return h;
}

/* The packed factor (n) against the dense double reference: max error relative to the
 * reference's largest entry. */
static double packed_err(size_t n, const float *packed, const double *ref) {
  double m = 0.0, e = 0.0;
  size_t k = 0;
  for (size_t i = 0; i < n; i++)
    for (size_t j = i; j < n; j++, k++) {
      m = fmax(m, fabs(ref[i * n + j]));
      e = fmax(e, fabs((double)packed[k] - ref[i * n + j]));
    }
  return e / m;
}

/* ref += w v v^T for the n-vector v. */
static void outer_add(size_t n, const double *v, double w, double *ref) {
  for (size_t i = 0; i < n; i++)
    for (size_t j = 0; j < n; j++) ref[i * n + j] += w * v[i] * v[j];
}

/* ------------------------------------------------------------------------------------ */
/* Dense factors                                                                          */

static void test_dense_factors(void **state) {
  ac_backend *be = backend(state);
  const size_t rows = 9, in = 5, lda = 7, out = 4, ldg = 6;
  const float s = 9.0f;
  float *a = host_random(rows * lda), *g = host_random(rows * ldg);
  float *da = dev_upload(be, rows * lda, a), *dg = dev_upload(be, rows * ldg, g);
  float *ws = dev_alloc(be, ac_kfac_dense_workspace_floats(rows, in, 1));
  float *fa = dev_alloc(be, ac_packed_len(in + 1)), *fg = dev_alloc(be, ac_packed_len(out));
  double *ref = xcalloc((in + 1) * (in + 1), sizeof *ref), v[8];
  for (int bias = 0; bias < 2; bias++) {
    size_t n = in + (size_t)bias;
    OK(ac_kfac_dense_factor_a(be, rows, in, da, lda, bias, fa, bias ? ws : NULL));
    memset(ref, 0, n * n * sizeof *ref);
    for (size_t r = 0; r < rows; r++) { /* one sample at a time */
      for (size_t i = 0; i < in; i++) v[i] = a[r * lda + i];
      v[in] = 1.0;
      outer_add(n, v, 1.0 / rows, ref);
    }
    float *h = download(be, ac_packed_len(n), fa);
    assert_true(packed_err(n, h, ref) < 1e-6);
    free(h);
  }
  OK(ac_kfac_dense_factor_g(be, rows, out, dg, ldg, s, fg));
  memset(ref, 0, out * out * sizeof *ref);
  for (size_t r = 0; r < rows; r++) {
    for (size_t i = 0; i < out; i++) v[i] = s * g[r * ldg + i]; /* per-example gradient */
    outer_add(out, v, 1.0 / rows, ref);
  }
  float *h = download(be, ac_packed_len(out), fg);
  assert_true(packed_err(out, h, ref) < 1e-6);
  free(h);
  /* Errors: nothing issued. */
  assert_int_equal(ac_kfac_dense_factor_a(be, rows, in, da, in - 1, 0, fa, NULL), AC_EINVAL);
  assert_int_equal(ac_kfac_dense_factor_a(be, rows, in, da, lda, 1, fa, NULL), AC_EINVAL);
  assert_int_equal(ac_kfac_dense_factor_a(be, 0, in, da, lda, 0, fa, NULL), AC_EINVAL);
  assert_int_equal(ac_kfac_dense_factor_g(be, rows, out, dg, ldg, 0.0f, fg), AC_EINVAL);
  assert_int_equal(ac_kfac_dense_factor_g(be, rows, out, dg, ldg, NAN, fg), AC_EINVAL);
  assert_int_equal(ac_kfac_dense_workspace_floats(rows, in, 0), 0);
  ac_free(be, da);
  ac_free(be, dg);
  ac_free(be, ws);
  ac_free(be, fa);
  ac_free(be, fg);
  free(a);
  free(g);
  free(ref);
}

/* ------------------------------------------------------------------------------------ */
/* Convolution factors                                                                    */

/* The patch of image b at output position (oy, ox), read straight from the NCHW input
 * (zeros in the padding), in im2col's row order (ch * kh + p) * kw + q, then a 1. */
static void patch(const ac_conv2d_geom *g, const float *x, size_t b, size_t oy, size_t ox,
                  double *v) {
  size_t k = 0;
  for (size_t ch = 0; ch < g->c; ch++)
    for (size_t p = 0; p < g->kh; p++)
      for (size_t q = 0; q < g->kw; q++, k++) {
        long yy = (long)(oy * g->stride_h + p) - (long)g->pad_h;
        long xx = (long)(ox * g->stride_w + q) - (long)g->pad_w;
        int inside = yy >= 0 && xx >= 0 && yy < (long)g->h && xx < (long)g->w;
        v[k] = inside ? x[((b * g->c + ch) * g->h + (size_t)yy) * g->w + (size_t)xx] : 0.0;
      }
  v[k] = 1.0;
}

/* The conv factors fa (order ckk + bias) and fg (order oc) against brute force in double
 * over nimg images x (NCHW) and output gradients dy (NCHW) with loss scale s. */
static void check_conv_factors(ac_backend *be, const ac_conv2d_geom *g, const float *x,
                               const float *dy, size_t nimg, size_t oc, float s, int bias,
                               const float *fa, const float *fg) {
  size_t oh, ow;
  OK(ac_conv2d_out_hw(g, &oh, &ow));
  const size_t npos = oh * ow, n = g->c * g->kh * g->kw + (size_t)bias;
  double *ref = xcalloc(n * n, sizeof *ref), v[32];
  for (size_t b = 0; b < nimg; b++)
    for (size_t oy = 0; oy < oh; oy++)
      for (size_t ox = 0; ox < ow; ox++) { /* one position at a time */
        patch(g, x, b, oy, ox, v);
        outer_add(n, v, 1.0 / (double)(nimg * npos), ref);
      }
  float *h = download(be, ac_packed_len(n), fa);
  assert_true(packed_err(n, h, ref) < 1e-6);
  free(h);
  memset(ref, 0, n * n * sizeof *ref);
  for (size_t b = 0; b < nimg; b++)
    for (size_t t = 0; t < npos; t++) {
      for (size_t o = 0; o < oc; o++) v[o] = s * dy[(b * oc + o) * npos + t];
      outer_add(oc, v, 1.0 / (double)nimg, ref);
    }
  h = download(be, ac_packed_len(oc), fg);
  assert_true(packed_err(oc, h, ref) < 1e-6);
  free(h);
  free(ref);
}

static void conv_case(ac_backend *be, size_t stride, int bias) {
  ac_conv2d_geom g = {.n = 3,
                      .c = 2,
                      .h = 5,
                      .w = 4,
                      .kh = 3,
                      .kw = 3,
                      .stride_h = stride,
                      .stride_w = stride,
                      .pad_h = 1,
                      .pad_w = 1};
  size_t oh, ow;
  OK(ac_conv2d_out_hw(&g, &oh, &ow));
  const size_t npos = oh * ow, ckk = g.c * g.kh * g.kw, oc = 4, nimg = g.n;
  const size_t n = ckk + (size_t)bias;
  const float s = (float)nimg;
  float *x = host_random(nimg * g.c * g.h * g.w), *dy = host_random(nimg * oc * npos);
  float *dx = dev_upload(be, nimg * g.c * g.h * g.w, x),
        *ddy = dev_upload(be, nimg * oc * npos, dy);
  float *col = dev_alloc(be, nimg * ckk * npos);
  float *ws = dev_alloc(be, ac_kfac_conv_workspace_floats(2, ckk, npos, bias));
  float *fa = dev_alloc(be, ac_packed_len(n)), *fg = dev_alloc(be, ac_packed_len(oc));
  OK(ac_im2col(be, &g, dx, col));
  /* In two chunks, as a layer that im2cols two images at a time would call it. */
  OK(ac_kfac_conv_factor_a(be, 2, ckk, npos, col, bias, nimg, 0, fa, ws));
  OK(ac_kfac_conv_factor_a(be, 1, ckk, npos, col + 2 * ckk * npos, bias, nimg, 1, fa, ws));
  OK(ac_kfac_conv_factor_g(be, 2, oc, npos, ddy, s, nimg, 0, fg));
  OK(ac_kfac_conv_factor_g(be, 1, oc, npos, ddy + 2 * oc * npos, s, nimg, 1, fg));
  check_conv_factors(be, &g, x, dy, nimg, oc, s, bias, fa, fg);
  assert_int_equal(ac_kfac_conv_factor_a(be, 4, ckk, npos, col, bias, 3, 0, fa, ws), AC_EINVAL);
  assert_int_equal(ac_kfac_conv_factor_g(be, 1, oc, npos, ddy, -1.0f, 3, 0, fg), AC_EINVAL);
  ac_free(be, dx);
  ac_free(be, ddy);
  ac_free(be, col);
  ac_free(be, ws);
  ac_free(be, fa);
  ac_free(be, fg);
  free(x);
  free(dy);
}

static void test_conv_factors(void **state) {
  ac_backend *be = backend(state);
  conv_case(be, 1, 1);
  conv_case(be, 2, 0);
}

/* ------------------------------------------------------------------------------------ */
/* Batch norm diagonal Fisher                                                             */

/* Per-example losses l_n = 0.5 sum (y - t)^2 of a batch norm's output. */
static void bn_losses(ac_backend *be, ac_batchnorm *bn, const float *dx, size_t n, size_t per,
                      const float *t, double *l) {
  const float *y = NULL;
  OK(ac_batchnorm_forward(bn, dx, n, AC_MODE_TRAIN, &y));
  float *h = download(be, n * per, y);
  for (size_t b = 0; b < n; b++) {
    l[b] = 0.0;
    for (size_t i = 0; i < per; i++) {
      double d = (double)h[b * per + i] - t[b * per + i];
      l[b] += 0.5 * d * d;
    }
  }
  free(h);
}

/* The tiny net: batch norm, then squared loss against targets, mean over the batch. The
 * Fisher of gamma_c is (1/n) sum_n (d l_n / d gamma_c)^2; central differences of the
 * per-example losses are exact here up to rounding (l_n is quadratic in gamma and beta,
 * and neither changes the batch statistics). */
static void test_bn_fisher_fd(void **state) {
  ac_backend *be = backend(state);
  const size_t n = 5, c = 3, hw = 4, per = c * hw;
  ac_batchnorm bn;
  OK(ac_batchnorm_init(&bn, be, "bn", c, hw, 1e-5f, 0.1f, n));
  float gamma[3] = {0.7f, 1.3f, -0.4f}, beta[3] = {0.2f, -0.1f, 0.5f};
  OK(ac_tensor_upload(&bn.weight.value, gamma));
  OK(ac_tensor_upload(&bn.bias.value, beta));
  float *x = host_random(n * per), *t = host_random(n * per);
  float *dx = dev_upload(be, n * per, x);
  const float *y = NULL;
  OK(ac_batchnorm_forward(&bn, dx, n, AC_MODE_TRAIN, &y));
  float *xhat = dev_alloc(be, n * per);
  OK(ac_batchnorm_xhat(&bn, xhat));
  float *yh = download(be, n * per, y), *dyh = xcalloc(n * per, sizeof *dyh);
  for (size_t i = 0; i < n * per; i++) dyh[i] = (yh[i] - t[i]) / (float)n; /* mean loss */
  float *ddy = dev_upload(be, n * per, dyh);
  float *ws = dev_alloc(be, ac_kfac_bn_workspace_floats(n, c, hw));
  float *fgam = dev_alloc(be, c), *fbet = dev_alloc(be, c);
  OK(ac_kfac_bn_fisher(be, n, c, hw, ddy, xhat, (float)n, fgam, fbet, ws));
  float *hg = download(be, c, fgam), *hb = download(be, c, fbet);
  const float h = 1e-2f;
  double lp[5], lm[5];
  for (int which = 0; which < 2; which++) {
    float *par = which ? beta : gamma;
    ac_tensor *tv = which ? &bn.bias.value : &bn.weight.value;
    for (size_t ch = 0; ch < c; ch++) {
      float keep = par[ch];
      par[ch] = keep + h;
      OK(ac_tensor_upload(tv, par));
      bn_losses(be, &bn, dx, n, per, t, lp);
      par[ch] = keep - h;
      OK(ac_tensor_upload(tv, par));
      bn_losses(be, &bn, dx, n, per, t, lm);
      par[ch] = keep;
      OK(ac_tensor_upload(tv, par));
      double f = 0.0;
      for (size_t b = 0; b < n; b++) {
        double gr = (lp[b] - lm[b]) / (2.0 * h);
        f += gr * gr / (double)n;
      }
      double got = which ? hb[ch] : hg[ch];
      if (fabs(got - f) > 2e-3 * f + 1e-6)
        print_error("bn %s[%zu]: kernel %g, finite differences %g\n", which ? "beta" : "gamma", ch,
                    got, f);
      assert_true(fabs(got - f) <= 2e-3 * f + 1e-6);
      assert_true(f > 1e-4); /* not a vacuous comparison */
    }
  }
  /* Applied: p = grad / (f + damping). */
  float grad[3] = {1.0f, -2.0f, 0.5f};
  float *dgr = dev_upload(be, c, grad), *dp = dev_alloc(be, c), *w3 = dev_alloc(be, c);
  OK(ac_kfac_bn_precondition(be, c, dgr, fgam, 0.1f, dp, w3));
  float *hp = download(be, c, dp);
  for (size_t ch = 0; ch < c; ch++)
    assert_float_equal(hp[ch], grad[ch] / (hg[ch] + 0.1f), 1e-6 * (1 + fabs(hp[ch])));
  OK(ac_kfac_bn_precondition(be, c, dgr, fgam, 0.1f, dgr, w3)); /* in place */
  free(hp);
  hp = download(be, c, dgr);
  assert_float_equal(hp[0], grad[0] / (hg[0] + 0.1f), 1e-6 * (1 + fabs(hp[0])));
  assert_int_equal(ac_kfac_bn_precondition(be, c, dgr, fgam, 0.0f, dp, w3), AC_EINVAL);
  assert_int_equal(ac_kfac_bn_fisher(be, n, c, hw, ddy, xhat, (float)n, fgam, fbet, NULL),
                   AC_EINVAL);
  free(hp);
  free(hg);
  free(hb);
  free(x);
  free(t);
  free(yh);
  free(dyh);
  ac_free(be, dx);
  ac_free(be, ddy);
  ac_free(be, ws);
  ac_free(be, fgam);
  ac_free(be, fbet);
  ac_free(be, dgr);
  ac_free(be, dp);
  ac_free(be, w3);
  ac_free(be, xhat);
  ac_batchnorm_destroy(&bn);
}

/* ------------------------------------------------------------------------------------ */
/* Preconditioned update and KL clip                                                      */

/* G^-1 [gw | gb] A^-1 against double loops, within the float bound of the two products'
 * sums ((out + n) u times the same products of magnitudes). Orders past 256 (the
 * Transformer's 384-513) take the products' k in chunks (accel/kfac.c). */
static void test_precondition(void **state) {
  ac_backend *be = backend(state);
  const size_t shapes[][2] = {{5, 4}, {300, 280}, {40, 520}}; /* out, in */
  for (size_t sh = 0; sh < sizeof shapes / sizeof shapes[0]; sh++)
    for (int bias = 0; bias < 2; bias++) {
      const size_t out = shapes[sh][0], in = shapes[sh][1], n = in + (size_t)bias;
      float *gw = host_random(out * in), *gb = host_random(out);
      float *gi = host_random(out * out), *ai = host_random(n * n);
      float *dgw = dev_upload(be, out * in, gw), *dgb = dev_upload(be, out, gb);
      float *dgi = dev_upload(be, out * out, gi), *dai = dev_upload(be, n * n, ai);
      float *dpw = dev_alloc(be, out * in), *dpb = dev_alloc(be, out);
      float *ws = dev_alloc(be, ac_kfac_precondition_workspace_floats(out, in, bias));
      OK(ac_kfac_precondition(be, out, in, dgw, bias ? dgb : NULL, dgi, dai, dpw, bias ? dpb : NULL,
                              ws));
      /* Host: G^-1 [gw | gb] A^-1 in double, and the same of the magnitudes. */
      double *m = xcalloc(out * n, sizeof *m), *t = xcalloc(out * n, sizeof *t);
      double *ma = xcalloc(out * n, sizeof *ma), *ta = xcalloc(out * n, sizeof *ta);
      for (size_t i = 0; i < out; i++)
        for (size_t j = 0; j < n; j++) m[i * n + j] = j < in ? gw[i * in + j] : gb[i];
      for (size_t i = 0; i < out; i++)
        for (size_t k = 0; k < out; k++)
          for (size_t j = 0; j < n; j++) {
            t[i * n + j] += (double)gi[i * out + k] * m[k * n + j];
            ta[i * n + j] += fabs((double)gi[i * out + k] * m[k * n + j]);
          }
      memset(m, 0, out * n * sizeof *m);
      for (size_t i = 0; i < out; i++)
        for (size_t k = 0; k < n; k++)
          for (size_t j = 0; j < n; j++) {
            m[i * n + j] += t[i * n + k] * ai[k * n + j];
            ma[i * n + j] += ta[i * n + k] * fabs((double)ai[k * n + j]);
          }
      float *pw = download(be, out * in, dpw), *pb = download(be, out, dpb);
      const double u = ((double)(out + n) + 2.0) * 0x1p-24;
      for (size_t i = 0; i < out; i++) {
        for (size_t j = 0; j < in; j++)
          assert_true(fabs(pw[i * in + j] - m[i * n + j]) <= u * ma[i * n + j] + 1e-30);
        if (bias) assert_true(fabs(pb[i] - m[i * n + in]) <= u * ma[i * n + in] + 1e-30);
      }
      /* In place: pw = gw, pb = gb. */
      OK(ac_kfac_precondition(be, out, in, dgw, bias ? dgb : NULL, dgi, dai, dgw, bias ? dgb : NULL,
                              ws));
      free(pw);
      pw = download(be, out * in, dgw);
      assert_true(fabs(pw[3] - m[3 / in * n + 3 % in]) <= u * ma[3 / in * n + 3 % in] + 1e-30);
      assert_int_equal(ac_kfac_precondition(be, out, in, dgw, dgb, dgi, dai, dpw, NULL, ws),
                       AC_EINVAL);
      free(gw);
      free(gb);
      free(gi);
      free(ai);
      free(m);
      free(t);
      free(ma);
      free(ta);
      free(pw);
      free(pb);
      ac_free(be, dgw);
      ac_free(be, dgb);
      ac_free(be, dgi);
      ac_free(be, dai);
      ac_free(be, dpw);
      ac_free(be, dpb);
      ac_free(be, ws);
    }
}

/* The eigen-form update against the numerics core's pc_kfac_eigen_update_f64 on the same
 * eigen forms (from pc_kfac_eigen_f32 of random factors), with and without a bias. */
static void test_eigen_precondition(void **state) {
  ac_backend *be = backend(state);
  const size_t out = 4, in = 6;
  const float lambda = 0.05f;
  for (int bias = 0; bias < 2; bias++) {
    size_t n = in + (size_t)bias;
    float *fa = xcalloc(ac_packed_len(n), sizeof *fa),
          *fg = xcalloc(ac_packed_len(out), sizeof *fg);
    float *ra = host_random(n * 2 * n), *rg = host_random(out * 2 * out);
    for (size_t i = 0, k = 0; i < n; i++) /* packed (1/2n) R R^T */
      for (size_t j = i; j < n; j++, k++)
        for (size_t c = 0; c < 2 * n; c++)
          fa[k] += ra[i * 2 * n + c] * ra[j * 2 * n + c] / (2.0f * n);
    for (size_t i = 0, k = 0; i < out; i++)
      for (size_t j = i; j < out; j++, k++)
        for (size_t c = 0; c < 2 * out; c++)
          fg[k] += rg[i * 2 * out + c] * rg[j * 2 * out + c] / (2.0f * out);
    float *qa = xcalloc(n * n, sizeof *qa), *va = xcalloc(n, sizeof *va);
    float *qg = xcalloc(out * out, sizeof *qg), *vg = xcalloc(out, sizeof *vg);
    assert_int_equal(pc_kfac_eigen_f32(n, fa, qa, va), PC_OK);
    assert_int_equal(pc_kfac_eigen_f32(out, fg, qg, vg), PC_OK);
    float *gw = host_random(out * in), *gb = host_random(out);
    double *g64 = xcalloc(out * n, sizeof *g64), *p64 = xcalloc(out * n, sizeof *p64);
    double *qa64 = xcalloc(n * n, sizeof *qa64), *va64 = xcalloc(n, sizeof *va64);
    double *qg64 = xcalloc(out * out, sizeof *qg64), *vg64 = xcalloc(out, sizeof *vg64);
    for (size_t i = 0; i < out; i++)
      for (size_t j = 0; j < n; j++) g64[i * n + j] = j < in ? gw[i * in + j] : gb[i];
    for (size_t i = 0; i < n * n; i++) qa64[i] = qa[i];
    for (size_t i = 0; i < n; i++) va64[i] = va[i];
    for (size_t i = 0; i < out * out; i++) qg64[i] = qg[i];
    for (size_t i = 0; i < out; i++) vg64[i] = vg[i];
    assert_int_equal(pc_kfac_eigen_update_f64(out, n, qg64, vg64, g64, n, qa64, va64, lambda, p64),
                     PC_OK);
    float *dgw = dev_upload(be, out * in, gw), *dgb = dev_upload(be, out, gb);
    float *dqa = dev_upload(be, n * n, qa), *dva = dev_upload(be, n, va);
    float *dqg = dev_upload(be, out * out, qg), *dvg = dev_upload(be, out, vg);
    float *dpw = dev_alloc(be, out * in), *dpb = dev_alloc(be, out);
    float *ws = dev_alloc(be, ac_kfac_eigen_precondition_workspace_floats(out, in, bias));
    OK(ac_kfac_eigen_precondition(be, out, in, dgw, bias ? dgb : NULL, dqg, dvg, dqa, dva, lambda,
                                  dpw, bias ? dpb : NULL, ws));
    float *pw = download(be, out * in, dpw), *pb = download(be, out, dpb);
    double scale = 0.0;
    for (size_t i = 0; i < out * n; i++) scale = fmax(scale, fabs(p64[i]));
    for (size_t i = 0; i < out; i++) {
      for (size_t j = 0; j < in; j++)
        assert_float_equal(pw[i * in + j], p64[i * n + j], 1e-5 * scale);
      if (bias) assert_float_equal(pb[i], p64[i * n + in], 1e-5 * scale);
    }
    assert_int_equal(ac_kfac_eigen_precondition(be, out, in, dgw, bias ? dgb : NULL, dqg, dvg, dqa,
                                                dva, -1.0f, dpw, bias ? dpb : NULL, ws),
                     AC_EINVAL);
    free(fa);
    free(fg);
    free(ra);
    free(rg);
    free(qa);
    free(va);
    free(qg);
    free(vg);
    free(gw);
    free(gb);
    free(g64);
    free(p64);
    free(qa64);
    free(va64);
    free(qg64);
    free(vg64);
    free(pw);
    free(pb);
    ac_free(be, dgw);
    ac_free(be, dgb);
    ac_free(be, dqa);
    ac_free(be, dva);
    ac_free(be, dqg);
    ac_free(be, dvg);
    ac_free(be, dpw);
    ac_free(be, dpb);
    ac_free(be, ws);
  }
}

static void test_kl_clip(void **state) {
  ac_backend *be = backend(state);
  const size_t n1 = 7, n2 = 300;
  float *p1 = host_random(n1), *g1 = host_random(n1), *p2 = host_random(n2);
  float *g2 = xcalloc(n2, sizeof *g2);
  for (size_t i = 0; i < n2; i++) g2[i] = p2[i] * 0.5f; /* a positive sum, well away from 0 */
  double vg = pc_kfac_dot_f32(n1, p1, g1) + pc_kfac_dot_f32(n2, p2, g2), want = 0.0;
  float *d1 = dev_upload(be, n1, p1), *e1 = dev_upload(be, n1, g1);
  float *d2 = dev_upload(be, n2, p2), *e2 = dev_upload(be, n2, g2), *one = dev_alloc(be, 1);
  ac_kfac_pg layers[2] = {{n1, d1, e1, NULL}, {n2, d2, e2, NULL}};
  const double lr = 0.5;
  assert_int_equal(pc_kfac_kl_scale(1e-3, lr, vg, &want), PC_OK);
  assert_true(want < 0.5); /* this case clips */
  double nu = -1.0;
  OK(ac_kfac_kl_clip(be, layers, 2, lr, 1e-3, one, &nu));
  assert_float_equal(nu, want, 1e-5 * want);
  float *h1 = download(be, n1, d1), *h2 = download(be, n2, d2);
  for (size_t i = 0; i < n1; i++) assert_float_equal(h1[i], p1[i] * want, 1e-6);
  for (size_t i = 0; i < n2; i++) assert_float_equal(h2[i], p2[i] * want, 1e-6);
  /* Into out (here the gradient itself): the same floats as in place, p untouched; then,
   * unclipped, p copied there as it is. */
  float *f1 = dev_upload(be, n1, p1), *f2 = dev_upload(be, n2, p2);
  float *o2 = dev_upload(be, n2, g2);
  ac_kfac_pg into[2] = {{n1, f1, e1, e1}, {n2, f2, o2, o2}};
  double nu_into = -1.0;
  OK(ac_kfac_kl_clip(be, into, 2, lr, 1e-3, one, &nu_into));
  assert_true(nu_into == nu);
  float *x1 = download(be, n1, e1), *x2 = download(be, n2, o2), *y1 = download(be, n1, f1);
  assert_memory_equal(x1, h1, n1 * sizeof *x1);
  assert_memory_equal(x2, h2, n2 * sizeof *x2);
  assert_memory_equal(y1, p1, n1 * sizeof *y1);
  OK(ac_kfac_kl_clip(be, into, 2, 1e-6, 1e-3, one, &nu_into));
  assert_true(nu_into == 1.0);
  free(x1);
  x1 = download(be, n1, e1);
  assert_memory_equal(x1, p1, n1 * sizeof *x1);
  OK(ac_memcpy_h2d(be, e1, g1, n1 * sizeof *g1));
  free(x1);
  free(x2);
  free(y1);
  ac_free(be, f1);
  ac_free(be, f2);
  ac_free(be, o2);
  /* A learning rate small enough that nothing is clipped: p unchanged, nu = 1. */
  OK(ac_kfac_kl_clip(be, layers, 2, 1e-6, 1e-3, one, &nu));
  assert_true(nu == 1.0);
  free(h1);
  h1 = download(be, n1, d1);
  for (size_t i = 0; i < n1; i++) assert_float_equal(h1[i], p1[i] * want, 1e-6);
  /* A NaN gradient: nothing scaled, nu = 0. */
  g1[0] = NAN;
  OK(ac_memcpy_h2d(be, e1, g1, n1 * sizeof *g1));
  assert_int_equal(ac_kfac_kl_clip(be, layers, 2, lr, 1e-3, one, &nu), AC_EINVAL);
  assert_true(nu == 0.0);
  assert_int_equal(ac_kfac_kl_clip(be, layers, 2, lr, 0.0, one, &nu), AC_EINVAL);
  assert_int_equal(ac_kfac_kl_clip(be, layers, 2, lr, 1e-3, NULL, &nu), AC_EINVAL);
  free(p1);
  free(g1);
  free(p2);
  free(g2);
  free(h1);
  free(h2);
  ac_free(be, d1);
  ac_free(be, e1);
  ac_free(be, d2);
  ac_free(be, e2);
  ac_free(be, one);
}

/* ------------------------------------------------------------------------------------ */
/* One K-FAC step on linear least squares                                                 */

/* |X~^T (X~ [W b]^T - T)|_F of the layer's current weights, in double. */
static double normal_residual(ac_backend *be, ac_linear *fc, size_t N, const float *x,
                              const float *t) {
  const size_t in = fc->in, out = fc->out, n = in + 1;
  float *w = download(be, out * in, ac_tensor_f32(&fc->weight.value));
  float *b = download(be, out, ac_tensor_f32(&fc->bias.value));
  double *ne = xcalloc(n * out, sizeof *ne), r2 = 0.0;
  for (size_t r = 0; r < N; r++)
    for (size_t o = 0; o < out; o++) {
      double pred = (double)b[o] - t[r * out + o];
      for (size_t i = 0; i < in; i++) pred += (double)w[o * in + i] * x[r * in + i];
      for (size_t i = 0; i < n; i++) ne[i * out + o] += (i < in ? x[r * in + i] : 1.0) * pred;
    }
  for (size_t i = 0; i < n * out; i++) r2 += ne[i] * ne[i];
  free(w);
  free(b);
  free(ne);
  return sqrt(r2);
}

/* A linear layer y = W x + b under the squared loss L = (1/2N) sum |y_n - t_n|^2, full
 * batch. The model's Fisher (labels sampled from N(y, I)) has G = E[eps eps^T] = I; the
 * sampled noise rows here are the first `out` columns of a Sylvester-Hadamard matrix, whose
 * columns are orthogonal, so the sample G is exactly I and the test exact up to rounding.
 * A = X~^T X~ / N (X~ = [X 1]). With damping -> 0 one K-FAC step at lr 1,
 * [W b] -= G^-1 grad A^-1 = (1/N) E^T X~ (X~^T X~ / N)^-1, solves the normal equations
 * X~^T (X~ [W b]^T - T) = 0. */
static void test_least_squares_step(void **state) {
  ac_backend *be = backend(state);
  const size_t N = 64, in = 6, out = 3, n = in + 1;
  ac_linear fc;
  OK(ac_linear_init(&fc, be, "fc", in, out, 1, N, 11));
  float *x = host_random(N * in), *t = host_random(N * out);
  float *b0 = host_random(out);
  OK(ac_tensor_upload(&fc.bias.value, b0));
  float *dx = dev_upload(be, N * in, x);
  const float *dy_out = NULL;
  OK(ac_linear_forward(&fc, dx, N, &dy_out));
  float *y = download(be, N * out, dy_out), *e = xcalloc(N * out, sizeof *e);
  for (size_t i = 0; i < N * out; i++) e[i] = (y[i] - t[i]) / (float)N; /* dL/dy */
  float *de = dev_upload(be, N * out, e);
  OK(ac_linear_backward(&fc, de, NULL));
  /* Factors on the device. */
  float *ws = dev_alloc(be, ac_kfac_dense_workspace_floats(N, in, 1));
  float *fa = dev_alloc(be, ac_packed_len(n)), *fg = dev_alloc(be, ac_packed_len(out));
  OK(ac_kfac_dense_factor_a(be, N, in, dx, in, 1, fa, ws));
  float *s = xcalloc(N * out, sizeof *s);
  for (size_t r = 0; r < N; r++) /* d(loss at sampled labels)/dy = -eps / N */
    for (size_t o = 0; o < out; o++)
      s[r * out + o] = (__builtin_popcountll(r & (o + 1)) % 2 ? 1.0f : -1.0f) / (float)N;
  float *ds = dev_upload(be, N * out, s);
  OK(ac_kfac_dense_factor_g(be, N, out, ds, out, (float)N, fg));
  float *ha = download(be, ac_packed_len(n), fa), *hg = download(be, ac_packed_len(out), fg);
  for (size_t i = 0, k = 0; i < out; i++) /* G == I exactly */
    for (size_t j = i; j < out; j++, k++) assert_float_equal(hg[k], i == j, 1e-6);
  /* Damped inverses on the host (the daemon's part), damping -> 0. */
  pc_kfac_damping d;
  assert_int_equal(pc_kfac_damping_split(n, pc_kfac_trace_f32(n, ha), out,
                                         pc_kfac_trace_f32(out, hg), 1e-12, 1, &d),
                   PC_OK);
  float *ai = xcalloc(n * n, sizeof *ai), *gi = xcalloc(out * out, sizeof *gi);
  assert_int_equal(pc_kfac_inverse_f32(n, ha, d.damp_a, PC_KFAC_INV_CHOLESKY, ai, NULL), PC_OK);
  assert_int_equal(pc_kfac_inverse_f32(out, hg, d.damp_g, PC_KFAC_INV_CHOLESKY, gi, NULL), PC_OK);
  float *dai = dev_upload(be, n * n, ai), *dgi = dev_upload(be, out * out, gi);
  float *pw = dev_alloc(be, out * in), *pb = dev_alloc(be, out);
  float *pws = dev_alloc(be, ac_kfac_precondition_workspace_floats(out, in, 1));
  OK(ac_kfac_precondition(be, out, in, ac_tensor_f32(&fc.weight.grad), ac_tensor_f32(&fc.bias.grad),
                          dgi, dai, pw, pb, pws));
  double res[2];
  res[0] = normal_residual(be, &fc, N, x, t);
  OK(ac_axpby(be, out * in, -1.0f, pw, 1.0f, ac_tensor_f32(&fc.weight.value),
              ac_tensor_f32(&fc.weight.value)));
  OK(ac_axpby(be, out, -1.0f, pb, 1.0f, ac_tensor_f32(&fc.bias.value),
              ac_tensor_f32(&fc.bias.value)));
  res[1] = normal_residual(be, &fc, N, x, t);
  print_message("least squares: normal-equation residual %.3g -> %.3g\n", res[0], res[1]);
  assert_true(res[0] > 1.0); /* the start is far from the solution */
  assert_true(res[1] < 1e-4 * res[0]);
  free(x);
  free(t);
  free(b0);
  free(y);
  free(e);
  free(s);
  free(ha);
  free(hg);
  free(ai);
  free(gi);
  ac_free(be, dx);
  ac_free(be, de);
  ac_free(be, ws);
  ac_free(be, fa);
  ac_free(be, fg);
  ac_free(be, ds);
  ac_free(be, dai);
  ac_free(be, dgi);
  ac_free(be, pw);
  ac_free(be, pb);
  ac_free(be, pws);
  ac_linear_destroy(&fc);
}

/* ------------------------------------------------------------------------------------ */
/* Layer hooks: the factors from what dense, conv and batch-norm layers show in backward    */

typedef struct {
  ac_backend *be;
  int calls[3];
  size_t first_seen;
  float s;
  float *fa, *fg, *ws;                       /* dense and conv factors */
  float *gmask, *xhat, *fgam, *fbeta, *bnws; /* batch norm */
} hook_rec;

/* A K-FAC worker's hook in miniature: every view turned into its factors. */
static int record_hook(void *ctx, const ac_hook_view *v) {
  hook_rec *r = ctx;
  int rc = AC_OK, bias = v->bias != NULL;
  r->calls[v->kind]++;
  switch (v->kind) {
    case AC_HOOK_DENSE:
      rc = ac_kfac_dense_factor_a(r->be, v->rows, v->in, v->a, v->lda, bias, r->fa, r->ws);
      if (rc == AC_OK)
        rc = ac_kfac_dense_factor_g(r->be, v->rows, v->out, v->g, v->ldg, r->s, r->fg);
      break;
    case AC_HOOK_CONV:
      r->first_seen += v->first;
      rc = ac_kfac_conv_cols_factor_a(r->be, v->in, v->cols, v->a, v->lda, v->npos, bias, v->batch,
                                      v->first > 0, r->fa, r->ws);
      if (rc == AC_OK)
        rc = ac_kfac_conv_cols_factor_g(r->be, v->out, v->cols, v->g, v->ldg, r->s, v->batch,
                                        v->first > 0, r->fg);
      break;
    case AC_HOOK_BATCHNORM: {
      size_t count = v->batch * v->in * v->npos;
      const float *g = v->g;
      if (v->relu_y != NULL) { /* the gradient at the affine output: masked by the ReLU */
        rc = ac_unary_backward(r->be, AC_UNARY_RELU, count, v->relu_y, v->g, r->gmask);
        g = r->gmask;
      }
      if (rc == AC_OK) rc = ac_batchnorm_xhat(v->bn, r->xhat);
      if (rc == AC_OK)
        rc = ac_kfac_bn_fisher(r->be, v->batch, v->in, v->npos, g, r->xhat, r->s, r->fgam, r->fbeta,
                               r->bnws);
      break;
    }
  }
  return rc;
}

static void test_layer_hooks(void **state) {
  ac_backend *be = backend(state);
  hook_rec r = {.be = be, .s = 3.0f};
  r.fa = dev_alloc(be, ac_packed_len(19));
  r.fg = dev_alloc(be, ac_packed_len(4));
  r.ws = dev_alloc(be, 19 * 60);
  ac_hook hook = {record_hook, &r};

  /* Convolution with a bias, 3 images in chunks of 2: the first chunk's gradient reaches
   * the hook reordered channel-major, the second's as the NCHW slice. */
  ac_conv2d conv;
  OK(ac_conv2d_init(&conv, be, "c", 2, 4, 5, 4, 3, 1, 1, 1, 3, 2, NULL, 7));
  ac_conv2d_geom g = conv.g;
  g.n = 3;
  size_t npos = conv.oh * conv.ow;
  float *x = host_random(3 * 2 * 5 * 4), *dy = host_random(3 * 4 * npos);
  float *dx = dev_upload(be, 3 * 2 * 5 * 4, x), *ddy = dev_upload(be, 3 * 4 * npos, dy);
  const float *y = NULL, *gx = NULL;
  OK(ac_conv2d_forward(&conv, dx, 3, &y));
  OK(ac_conv2d_backward(&conv, ddy, &gx)); /* no hook: nothing called */
  assert_int_equal(r.calls[AC_HOOK_CONV], 0);
  conv.hook = hook;
  OK(ac_conv2d_backward(&conv, ddy, &gx));
  assert_int_equal(r.calls[AC_HOOK_CONV], 2);
  assert_int_equal(r.first_seen, 2);
  check_conv_factors(be, &g, x, dy, 3, 4, r.s, 1, r.fa, r.fg);
  ac_conv2d_destroy(&conv);

  /* Dense: the factors of the layer's own input and output gradient. */
  ac_linear fc;
  OK(ac_linear_init(&fc, be, "fc", 5, 4, 1, 9, 3));
  float *xa = host_random(9 * 5), *ga = host_random(9 * 4);
  float *dxa = dev_upload(be, 9 * 5, xa), *dga = dev_upload(be, 9 * 4, ga);
  float *fa2 = dev_alloc(be, ac_packed_len(6)), *fg2 = dev_alloc(be, ac_packed_len(4));
  OK(ac_linear_forward(&fc, dxa, 9, &y));
  fc.hook = hook;
  OK(ac_linear_backward(&fc, dga, &gx));
  assert_int_equal(r.calls[AC_HOOK_DENSE], 1);
  OK(ac_kfac_dense_factor_a(be, 9, 5, dxa, 5, 1, fa2, r.ws));
  OK(ac_kfac_dense_factor_g(be, 9, 4, dga, 4, r.s, fg2));
  float *h1 = download(be, ac_packed_len(6), r.fa), *h2 = download(be, ac_packed_len(6), fa2);
  assert_memory_equal(h1, h2, ac_packed_len(6) * sizeof(float));
  free(h1);
  free(h2);
  h1 = download(be, ac_packed_len(4), r.fg);
  h2 = download(be, ac_packed_len(4), fg2);
  assert_memory_equal(h1, h2, ac_packed_len(4) * sizeof(float));
  free(h1);
  free(h2);
  ac_linear_destroy(&fc);

  /* Batch norm with a fused ReLU: the diagonal Fisher of the gradient at the affine output
   * (masked by the ReLU) against per-example sums in double on the host. */
  const size_t n = 5, c = 3, hw = 4, cnt = n * c * hw;
  ac_batchnorm bn;
  OK(ac_batchnorm_init(&bn, be, "bn", c, hw, 1e-5f, 0.1f, n));
  OK(ac_batchnorm_fuse_relu(&bn));
  r.gmask = dev_alloc(be, cnt);
  r.xhat = dev_alloc(be, cnt);
  r.fgam = dev_alloc(be, c);
  r.fbeta = dev_alloc(be, c);
  r.bnws = dev_alloc(be, ac_kfac_bn_workspace_floats(n, c, hw));
  float *xb = host_random(cnt), *gb = host_random(cnt);
  float *dxb = dev_upload(be, cnt, xb), *dgb = dev_upload(be, cnt, gb);
  OK(ac_batchnorm_forward(&bn, dxb, n, AC_MODE_TRAIN, &y));
  float *hy = download(be, cnt, y);
  bn.hook = hook;
  OK(ac_batchnorm_backward(&bn, dgb, &gx));
  assert_int_equal(r.calls[AC_HOOK_BATCHNORM], 1);
  float *hg = download(be, c, r.fgam), *hb = download(be, c, r.fbeta);
  for (size_t ch = 0; ch < c; ch++) {
    double mean = 0.0, var = 0.0, fgam = 0.0, fbeta = 0.0;
    for (size_t b = 0; b < n; b++)
      for (size_t i = 0; i < hw; i++) mean += xb[(b * c + ch) * hw + i] / (double)(n * hw);
    for (size_t b = 0; b < n; b++)
      for (size_t i = 0; i < hw; i++) {
        double d = xb[(b * c + ch) * hw + i] - mean;
        var += d * d / (double)(n * hw);
      }
    for (size_t b = 0; b < n; b++) {
      double dg = 0.0, db = 0.0;
      for (size_t i = 0; i < hw; i++) {
        size_t k = (b * c + ch) * hw + i;
        double gm = hy[k] > 0.0f ? gb[k] : 0.0;
        dg += r.s * gm * (xb[k] - mean) / sqrt(var + 1e-5);
        db += r.s * gm;
      }
      fgam += dg * dg / (double)n;
      fbeta += db * db / (double)n;
    }
    assert_true(fabs(hg[ch] - fgam) <= 1e-4 * fmax(fgam, 1e-3));
    assert_true(fabs(hb[ch] - fbeta) <= 1e-4 * fmax(fbeta, 1e-3));
  }
  free(hg);
  free(hb);
  free(hy);
  ac_batchnorm_destroy(&bn);

  /* A failing hook fails backward with its code. */
  ac_linear fc2;
  OK(ac_linear_init(&fc2, be, "fc2", 5, 4, 0, 9, 3));
  OK(ac_linear_forward(&fc2, dxa, 9, &y));
  float *fa_keep = r.fa;
  r.fa = NULL; /* the dense factor refuses a NULL output */
  fc2.hook = hook;
  assert_int_equal(ac_linear_backward(&fc2, dga, &gx), AC_EINVAL);
  ac_linear_destroy(&fc2);

  ac_free(be, fa_keep);
  ac_free(be, r.fg);
  ac_free(be, r.ws);
  ac_free(be, fa2);
  ac_free(be, fg2);
  ac_free(be, r.gmask);
  ac_free(be, r.xhat);
  ac_free(be, r.fgam);
  ac_free(be, r.fbeta);
  ac_free(be, r.bnws);
  ac_free(be, dx);
  ac_free(be, ddy);
  ac_free(be, dxa);
  ac_free(be, dga);
  ac_free(be, dxb);
  ac_free(be, dgb);
  free(x);
  free(dy);
  free(xa);
  free(ga);
  free(xb);
  free(gb);
}

/* ------------------------------------------------------------------------------------ */
/* Groups                                                                                  */

#define KFAC_TESTS                                                               \
  cmocka_unit_test(test_dense_factors), cmocka_unit_test(test_conv_factors),     \
      cmocka_unit_test(test_bn_fisher_fd), cmocka_unit_test(test_precondition),  \
      cmocka_unit_test(test_eigen_precondition), cmocka_unit_test(test_kl_clip), \
      cmocka_unit_test(test_least_squares_step), cmocka_unit_test(test_layer_hooks)

int main(void) {
  const struct CMUnitTest cpu[] = {KFAC_TESTS};
  const struct CMUnitTest cuda[] = {KFAC_TESTS};
  int failed = cmocka_run_group_tests_name("cpu", cpu, setup_cpu, teardown);
  failed += cmocka_run_group_tests_name("cuda", cuda, setup_cuda, teardown);
  return failed;
}
