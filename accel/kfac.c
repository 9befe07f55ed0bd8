/*
 * kfac.c -- K-FAC's worker kernels: the factors A and G of dense and convolution layers, the
 * batch-norm diagonal Fisher, the preconditioned update from inverses held on the device and
 * the KL clip. Written once against the backend primitives (syrk into packed storage, gemm,
 * strided copies, reductions), so every backend runs them unchanged. The formulas and the
 * normalisations are docs/kfac.md's; the scalar rules (KL scale) come from the numerics core.
 */
#include <math.h>
#include <stddef.h>

#include "gemm_small.h"
#include "optim.h"

/* ------------------------------------------------------------------------------------ */
/* Argument checks                                                                        */

static int scale_ok(float s) {
  return s > 0.0f && isfinite(s);
}

static int dense_check(const ac_backend *be, size_t rows, size_t n, const void *x, size_t ld,
                       const void *out) {
  if (!be || rows == 0 || n == 0 || !x || !out || ld < n) return AC_EINVAL;
  return AC_OK;
}

static int conv_check(const ac_backend *be, size_t nimg, size_t n, size_t npos, const void *x,
                      size_t batch, const void *out) {
  if (!be || nimg == 0 || n == 0 || npos == 0 || !x || !out || batch < nimg) return AC_EINVAL;
  return AC_OK;
}

/* ------------------------------------------------------------------------------------ */
/* Dense layers                                                                           */

size_t ac_kfac_dense_workspace_floats(size_t rows, size_t in, int has_bias) {
  return has_bias ? rows * (in + 1) : 0;
}

/* The inputs with a column of ones appended: ws (rows x (in + 1)). The ones come from one
 * fill of the whole buffer; the copy then overwrites all but the last column. */
static int append_ones(ac_backend *be, size_t rows, size_t in, const float *a, size_t lda,
                       float *ws) {
  int rc = ac_fill_f32(be, rows * (in + 1), ws, 1.0f);
  return rc == AC_OK ? ac_copy2d(be, rows, in, a, lda, ws, in + 1) : rc;
}

/* The Gram matrix C = alpha X^T X (X rows x n, row stride ld) packed into dst: device memory
 * (ac_syrk_packed, beta 0), or host memory (ac_syrk_packed_to_host: the same floats). */
static int gram(ac_backend *be, size_t n, size_t rows, float alpha, const float *x, size_t ld,
                float *dst, int host) {
  return host ? ac_syrk_packed_to_host(be, AC_TRANS, n, rows, alpha, x, ld, dst)
              : ac_syrk_packed(be, AC_TRANS, n, rows, alpha, x, ld, 0.0f, dst);
}

static int dense_a(ac_backend *be, size_t rows, size_t in, const float *a, size_t lda, int has_bias,
                   float *dst, float *ws, int host) {
  if (dense_check(be, rows, in, a, lda, dst) != AC_OK || (has_bias && !ws)) return AC_EINVAL;
  const float alpha = 1.0f / (float)rows;
  if (!has_bias) return gram(be, in, rows, alpha, a, lda, dst, host);
  int rc = append_ones(be, rows, in, a, lda, ws);
  if (rc != AC_OK) return rc;
  return gram(be, in + 1, rows, alpha, ws, in + 1, dst, host);
}

static int dense_g(ac_backend *be, size_t rows, size_t out, const float *g, size_t ldg,
                   float loss_scale, float *dst, int host) {
  if (dense_check(be, rows, out, g, ldg, dst) != AC_OK || !scale_ok(loss_scale)) return AC_EINVAL;
  /* (1/rows) sum (s g)(s g)^T: the scale folded into syrk's alpha. */
  const float alpha = (float)((double)loss_scale * loss_scale / (double)rows);
  return gram(be, out, rows, alpha, g, ldg, dst, host);
}

int ac_kfac_dense_factor_a(ac_backend *be, size_t rows, size_t in, const float *a, size_t lda,
                           int has_bias, float *a_packed, float *ws) {
  return dense_a(be, rows, in, a, lda, has_bias, a_packed, ws, 0);
}

int ac_kfac_dense_factor_g(ac_backend *be, size_t rows, size_t out, const float *g, size_t ldg,
                           float loss_scale, float *g_packed) {
  return dense_g(be, rows, out, g, ldg, loss_scale, g_packed, 0);
}

int ac_kfac_dense_factors_to_host(ac_backend *be, size_t rows, size_t in, size_t out,
                                  const float *a, size_t lda, const float *g, size_t ldg,
                                  int has_bias, float loss_scale, float *a_host, float *g_host,
                                  float *ws) {
  int rc = dense_a(be, rows, in, a, lda, has_bias, a_host, ws, 1);
  return rc == AC_OK ? dense_g(be, rows, out, g, ldg, loss_scale, g_host, 1) : rc;
}

/* ------------------------------------------------------------------------------------ */
/* Convolutions                                                                           */

size_t ac_kfac_conv_workspace_floats(size_t nimg, size_t ckk, size_t npos, int has_bias) {
  return has_bias ? nimg * (ckk + 1) * npos : 0;
}

/* Per image, x_b is an n x npos matrix (one column per position), so sum_t x_bt x_bt^T is one
 * syrk of x_b; the images accumulate through beta. One call per image rather than a
 * transpose to (positions, n) and one call: no extra n x positions buffer. */
static int syrk_images(ac_backend *be, size_t nimg, size_t n, size_t npos, const float *x,
                       float alpha, int accumulate, float *packed) {
  for (size_t b = 0; b < nimg; b++) {
    float beta = accumulate || b > 0 ? 1.0f : 0.0f;
    int rc = ac_syrk_packed(be, AC_NO_TRANS, n, npos, alpha, x + b * n * npos, npos, beta, packed);
    if (rc != AC_OK) return rc;
  }
  return AC_OK;
}

int ac_kfac_conv_factor_a(ac_backend *be, size_t nimg, size_t ckk, size_t npos, const float *col,
                          int has_bias, size_t batch, int accumulate, float *a_packed, float *ws) {
  if (conv_check(be, nimg, ckk, npos, col, batch, a_packed) != AC_OK || (has_bias && !ws))
    return AC_EINVAL;
  const float alpha = (float)(1.0 / ((double)batch * (double)npos));
  if (!has_bias) return syrk_images(be, nimg, ckk, npos, col, alpha, accumulate, a_packed);
  /* Each image's (ckk, npos) patch matrix gets a row of ones: (nimg, ckk + 1, npos). Seen as
   * nimg rows of ckk * npos values, the copy is one strided 2-D copy over a buffer of ones. */
  int rc = ac_fill_f32(be, nimg * (ckk + 1) * npos, ws, 1.0f);
  if (rc == AC_OK) rc = ac_copy2d(be, nimg, ckk * npos, col, ckk * npos, ws, (ckk + 1) * npos);
  if (rc != AC_OK) return rc;
  return syrk_images(be, nimg, ckk + 1, npos, ws, alpha, accumulate, a_packed);
}

int ac_kfac_conv_factor_g(ac_backend *be, size_t nimg, size_t out_c, size_t npos, const float *dy,
                          float loss_scale, size_t batch, int accumulate, float *g_packed) {
  if (conv_check(be, nimg, out_c, npos, dy, batch, g_packed) != AC_OK || !scale_ok(loss_scale))
    return AC_EINVAL;
  const float alpha = (float)((double)loss_scale * loss_scale / (double)batch);
  return syrk_images(be, nimg, out_c, npos, dy, alpha, accumulate, g_packed);
}

size_t ac_kfac_conv_cols_workspace_floats(size_t ckk, size_t cols, int has_bias) {
  return has_bias ? (ckk + 1) * cols : 0;
}

/* The columns hold every position of the chunk side by side, so the sum over images and
 * positions is one syrk of the (n, cols) matrix: no per-image calls. */
int ac_kfac_conv_cols_factor_a(ac_backend *be, size_t ckk, size_t cols, const float *col,
                               size_t ldc, size_t npos, int has_bias, size_t batch, int accumulate,
                               float *a_packed, float *ws) {
  if (dense_check(be, ckk, cols, col, ldc, a_packed) != AC_OK || npos == 0 || batch == 0 ||
      (has_bias && !ws))
    return AC_EINVAL;
  const float alpha = (float)(1.0 / ((double)batch * (double)npos));
  const float beta = accumulate ? 1.0f : 0.0f;
  if (!has_bias) return ac_syrk_packed(be, AC_NO_TRANS, ckk, cols, alpha, col, ldc, beta, a_packed);
  /* A row of ones under the columns: one fill, then the copy over all but the last row. */
  int rc = ac_fill_f32(be, (ckk + 1) * cols, ws, 1.0f);
  if (rc == AC_OK) rc = ac_copy2d(be, ckk, cols, col, ldc, ws, cols);
  if (rc != AC_OK) return rc;
  return ac_syrk_packed(be, AC_NO_TRANS, ckk + 1, cols, alpha, ws, cols, beta, a_packed);
}

int ac_kfac_conv_cols_factor_g(ac_backend *be, size_t out_c, size_t cols, const float *dyc,
                               size_t ldd, float loss_scale, size_t batch, int accumulate,
                               float *g_packed) {
  if (dense_check(be, out_c, cols, dyc, ldd, g_packed) != AC_OK || batch == 0 ||
      !scale_ok(loss_scale))
    return AC_EINVAL;
  const float alpha = (float)((double)loss_scale * loss_scale / (double)batch);
  return ac_syrk_packed(be, AC_NO_TRANS, out_c, cols, alpha, dyc, ldd, accumulate ? 1.0f : 0.0f,
                        g_packed);
}

/* ------------------------------------------------------------------------------------ */
/* Batch norm: diagonal Fisher                                                            */

size_t ac_kfac_bn_workspace_floats(size_t n, size_t c, size_t hw) {
  return n * c * hw + n * c;
}

/* f[c] = (s^2 / n) sum_n (sum_hw x[n][c][hw])^2, with ws the n * c per-example sums. */
static int per_example_sumsq(ac_backend *be, size_t n, size_t c, size_t hw, const float *x, float s,
                             float *f, float *ws) {
  int rc = ac_reduce(be, AC_REDUCE_SUM, 1, n * c, hw, 1.0f, x, 0.0f, ws);
  if (rc != AC_OK) return rc;
  return ac_reduce(be, AC_REDUCE_SUMSQ, n, c, 1, (float)((double)s * s / (double)n), ws, 0.0f, f);
}

int ac_kfac_bn_fisher(ac_backend *be, size_t n, size_t c, size_t hw, const float *dy,
                      const float *xhat, float loss_scale, float *f_gamma, float *f_beta,
                      float *ws) {
  if (!be || n == 0 || c == 0 || hw == 0 || !dy || !xhat || !f_gamma || !f_beta || !ws ||
      !scale_ok(loss_scale))
    return AC_EINVAL;
  float *prod = ws, *sums = ws + n * c * hw;
  int rc = ac_binary(be, AC_BIN_MUL, n * c * hw, dy, xhat, prod); /* dgamma's integrand */
  if (rc == AC_OK) rc = per_example_sumsq(be, n, c, hw, prod, loss_scale, f_gamma, sums);
  if (rc == AC_OK) rc = per_example_sumsq(be, n, c, hw, dy, loss_scale, f_beta, sums);
  return rc;
}

int ac_kfac_bn_precondition(ac_backend *be, size_t count, const float *grad, const float *fisher,
                            float damping, float *p, float *ws) {
  if (!be || !grad || !fisher || !p || !ws || !scale_ok(damping)) return AC_EINVAL;
  int rc = ac_affine(be, count, 1.0f, fisher, damping, ws);
  return rc == AC_OK ? ac_binary(be, AC_BIN_DIV, count, grad, ws, p) : rc;
}

/* ------------------------------------------------------------------------------------ */
/* Preconditioned update and KL clip                                                      */

size_t ac_kfac_precondition_workspace_floats(size_t out, size_t in, int has_bias) {
  return 2 * out * (in + (has_bias ? 1 : 0));
}

/* [gw | gb] into a matrix the products can read: gw itself without a bias, else the bias
 * gradient appended as a last column in the workspace buffer m (out x (in + 1)). */
static int gather_grad(ac_backend *be, size_t out, size_t in, const float *gw, const float *gb,
                       float *m, const float **grad) {
  *grad = gw;
  if (!gb) return AC_OK;
  int rc = ac_copy2d(be, out, in, gw, in, m, in + 1);
  if (rc == AC_OK) rc = ac_copy2d(be, out, 1, gb, 1, m + in, in + 1);
  *grad = m;
  return rc;
}

/* The inverse of gather_grad: [pw | pb] from the out x (in + 1) result r (bias case only). */
static int scatter_update(ac_backend *be, size_t out, size_t in, const float *r, float *pw,
                          float *pb) {
  int rc = ac_copy2d(be, out, in, r, in + 1, pw, in);
  return rc == AC_OK ? ac_copy2d(be, out, 1, r + in, in + 1, pb, 1) : rc;
}

/* C = A B (A m x k, B k x n, row-major) with k summed in the fewest equal chunks of at most
 * AC__GEMM_SMALL_MAX, accumulated in C: the inverses' orders past it (the Transformer's G of
 * qkv and fc1, A of fc2: 384-513) would send the whole product to OpenBLAS's AVX2 kernels,
 * and chunks of k keep every slice of it (the backend cuts m or n) on the CPU backend's
 * AVX-512F small-block kernel, about twice their rate (gemm_small.c). One product when k
 * fits: the same call as before. */
static int gemm_chunked_k(ac_backend *be, size_t m, size_t n, size_t k, const float *a, size_t lda,
                          const float *b, size_t ldb, float *c, size_t ldc) {
  const size_t chunks = (k + AC__GEMM_SMALL_MAX - 1) / AC__GEMM_SMALL_MAX;
  const size_t step = (k + chunks - 1) / chunks;
  int rc = AC_OK;
  for (size_t p = 0; p < k && rc == AC_OK; p += step) {
    const size_t kk = k - p < step ? k - p : step;
    rc = ac_sgemm(be, AC_NO_TRANS, AC_NO_TRANS, m, n, kk, 1.0f, a + p, lda, b + p * ldb, ldb,
                  p == 0 ? 0.0f : 1.0f, c, ldc);
  }
  return rc;
}

int ac_kfac_precondition(ac_backend *be, size_t out, size_t in, const float *gw, const float *gb,
                         const float *g_inv, const float *a_inv, float *pw, float *pb, float *ws) {
  if (!be || out == 0 || in == 0 || !gw || !g_inv || !a_inv || !pw || !ws) return AC_EINVAL;
  if ((gb == NULL) != (pb == NULL)) return AC_EINVAL;
  const size_t n = in + (gb ? 1 : 0);
  float *t = ws + out * n;
  const float *grad = NULL;
  int rc = gather_grad(be, out, in, gw, gb, ws, &grad);
  /* t = G^-1 grad; then t A^-1 into pw directly, or into the workspace to split it. */
  if (rc == AC_OK) rc = gemm_chunked_k(be, out, n, out, g_inv, out, grad, n, t, n);
  float *dst = gb ? ws : pw;
  if (rc == AC_OK) rc = gemm_chunked_k(be, out, n, n, t, n, a_inv, n, dst, n);
  if (rc == AC_OK && gb) rc = scatter_update(be, out, in, dst, pw, pb);
  return rc;
}

size_t ac_kfac_eigen_precondition_workspace_floats(size_t out, size_t in, int has_bias) {
  return 3 * out * (in + (has_bias ? 1 : 0));
}

int ac_kfac_eigen_precondition(ac_backend *be, size_t out, size_t in, const float *gw,
                               const float *gb, const float *qg, const float *vg, const float *qa,
                               const float *va, float lambda, float *pw, float *pb, float *ws) {
  if (!be || out == 0 || in == 0 || !gw || !qg || !vg || !qa || !va || !pw || !ws) return AC_EINVAL;
  if ((gb == NULL) != (pb == NULL) || !(lambda >= 0.0f) || !isfinite(lambda)) return AC_EINVAL;
  const size_t n = in + (gb ? 1 : 0);
  float *t = ws + out * n, *den = t + out * n;
  const float *grad = NULL;
  int rc = gather_grad(be, out, in, gw, gb, ws, &grad);
  /* t = Q_G^T grad; ws = t Q_A (grad is dead once t exists, so ws may hold it). */
  if (rc == AC_OK)
    rc = ac_sgemm(be, AC_TRANS, AC_NO_TRANS, out, n, out, 1.0f, qg, out, grad, n, 0.0f, t, n);
  if (rc == AC_OK)
    rc = ac_sgemm(be, AC_NO_TRANS, AC_NO_TRANS, out, n, n, 1.0f, t, n, qa, n, 0.0f, ws, n);
  /* den = v_G v_A^T + lambda (a rank-1 product), then ws /= den elementwise. */
  if (rc == AC_OK)
    rc = ac_sgemm(be, AC_NO_TRANS, AC_NO_TRANS, out, n, 1, 1.0f, vg, 1, va, n, 0.0f, den, n);
  if (rc == AC_OK) rc = ac_affine(be, out * n, 1.0f, den, lambda, den);
  if (rc == AC_OK) rc = ac_binary(be, AC_BIN_DIV, out * n, ws, den, ws);
  /* Back: t = Q_G ws; result = t Q_A^T into pw directly, or into ws to split it. */
  if (rc == AC_OK)
    rc = ac_sgemm(be, AC_NO_TRANS, AC_NO_TRANS, out, n, out, 1.0f, qg, out, ws, n, 0.0f, t, n);
  float *dst = gb ? ws : pw;
  if (rc == AC_OK)
    rc = ac_sgemm(be, AC_NO_TRANS, AC_TRANS, out, n, n, 1.0f, t, n, qa, n, 0.0f, dst, n);
  if (rc == AC_OK && gb) rc = scatter_update(be, out, in, dst, pw, pb);
  return rc;
}

int ac_kfac_kl_clip(ac_backend *be, const ac_kfac_pg *layers, size_t nlayers, double lr,
                    double kl_clip, float *dev1, double *nu) {
  if (!be || (nlayers > 0 && !layers) || !dev1) return AC_EINVAL;
  if (!(kl_clip > 0.0) || !isfinite(kl_clip) || !(lr >= 0.0) || !isfinite(lr)) return AC_EINVAL;
  for (size_t l = 0; l < nlayers; l++)
    if (layers[l].count > 0 && (!layers[l].p || !layers[l].grad)) return AC_EINVAL;
  /* sum_l <p_l, grad_l> as 1 x 1 products accumulated in one device float: one wait. */
  int rc = ac_fill_f32(be, 1, dev1, 0.0f);
  for (size_t l = 0; l < nlayers && rc == AC_OK; l++) {
    size_t k = layers[l].count;
    if (k > 0)
      rc = ac_sgemm(be, AC_NO_TRANS, AC_TRANS, 1, 1, k, 1.0f, layers[l].p, k, layers[l].grad, k,
                    1.0f, dev1, 1);
  }
  float sum = 0.0f;
  if (rc == AC_OK) rc = ac_memcpy_d2h(be, &sum, dev1, sizeof sum);
  if (rc != AC_OK) return rc;
  double scale = 1.0;
  if (pc_kfac_kl_scale(kl_clip, lr, (double)sum, &scale) != PC_OK) {
    if (nu) *nu = 0.0;
    return AC_EINVAL;
  }
  if (nu) *nu = scale;
  for (size_t l = 0; l < nlayers && rc == AC_OK; l++) {
    float *out = layers[l].out ? layers[l].out : layers[l].p;
    if (scale < 1.0)
      rc = ac_affine(be, layers[l].count, (float)scale, layers[l].p, 0.0f, out);
    else if (out != layers[l].p && layers[l].count > 0)
      rc = ac_memcpy_d2d(be, out, layers[l].p, layers[l].count * sizeof(float));
  }
  return rc;
}
