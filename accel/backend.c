/*
 * backend.c -- the public ac_* primitives: argument checks, then dispatch to the backend's
 * kernel table (ac__ops). Checks live here, once for all backends, so that the kernels in
 * backend_cpu.c and backend_cuda.cu assume valid arguments.
 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "ac_internal.h"

/* Why the last ac_backend_create of this thread failed (ac_backend_describe(NULL)). */
static _Thread_local char last_error[192] = "no backend created yet";

const char *ac_strerror(int status) {
  switch (status) {
    case AC_OK:
      return "success";
    case AC_EINVAL:
      return "invalid argument";
    case AC_ENOMEM:
      return "out of memory (host or device)";
    case AC_ENODEV:
      return "no usable device for this backend";
    case AC_ENOTSUP:
      return "backend or feature not compiled into this build";
    case AC_EDEVICE:
      return "device runtime or library error";
    case AC_EMISMATCH:
      return "backend or shape mismatch";
    default:
      return "unknown status code";
  }
}

/* ------------------------------------------------------------------------------------ */
/* Checks                                                                                  */

/* a * b without overflow, into *out. */
static int mul_ok(size_t a, size_t b, size_t *out) {
  if (a != 0 && b > SIZE_MAX / a) return 0;
  *out = a * b;
  return 1;
}

/* Every count product a kernel may form must fit: rows * ld and the like. */
static int extent_ok(size_t a, size_t b, size_t c) {
  size_t ab, abc;
  return mul_ok(a, b, &ab) && mul_ok(ab, c, &abc) && abc <= SIZE_MAX / sizeof(float);
}

static int be_ok(const ac_backend *be) {
  return be != NULL && be->ops != NULL;
}

/* A pointer may be NULL only when nothing is read or written through it. */
#define NEED(p, count) ((count) == 0 || (p) != NULL)

/* A row-major matrix of rows x cols with leading dimension ld is addressable. */
static int matrix_ok(const void *p, size_t rows, size_t cols, size_t ld) {
  if (rows == 0 || cols == 0) return 1;
  return p != NULL && ld >= cols && extent_ok(rows, ld, 1);
}

static int binary_op_ok(ac_binary_op op) {
  return (int)op >= (int)AC_BIN_ADD && (int)op <= (int)AC_BIN_DIV;
}

static int unary_op_ok(ac_unary_op op) {
  return (int)op >= 0 && (int)op < (int)AC_UNARY_COUNT;
}

static int trans_ok(ac_trans t) {
  return t == AC_NO_TRANS || t == AC_TRANS;
}

static int sgemm_check(ac_trans ta, ac_trans tb, size_t m, size_t n, size_t k, const float *a,
                       size_t lda, size_t stride_a, const float *b, size_t ldb, size_t stride_b,
                       const float *c, size_t ldc, size_t stride_c, size_t batch) {
  if (!trans_ok(ta) || !trans_ok(tb)) return AC_EINVAL;
  if (batch == 0 || m == 0 || n == 0) return AC_OK;
  size_t arows = ta == AC_NO_TRANS ? m : k, acols = ta == AC_NO_TRANS ? k : m;
  size_t brows = tb == AC_NO_TRANS ? k : n, bcols = tb == AC_NO_TRANS ? n : k;
  if (k > 0 && (!matrix_ok(a, arows, acols, lda) || !matrix_ok(b, brows, bcols, ldb)))
    return AC_EINVAL;
  if (!matrix_ok(c, m, n, ldc)) return AC_EINVAL;
  /* C_b must not overlap C_{b+1}: its last element is at (m-1)*ldc + n-1. */
  if (batch > 1 && stride_c < (m - 1) * ldc + n) return AC_EINVAL;
  if (!extent_ok(batch, stride_a, 1) || !extent_ok(batch, stride_b, 1) ||
      !extent_ok(batch, stride_c, 1))
    return AC_EINVAL;
  return AC_OK;
}

static int geom_check(const ac_conv2d_geom *g, size_t *oh, size_t *ow) {
  if (g == NULL || g->kh == 0 || g->kw == 0 || g->stride_h == 0 || g->stride_w == 0)
    return AC_EINVAL;
  if (g->pad_h >= g->kh || g->pad_w >= g->kw) return AC_EINVAL;
  if (g->h > SIZE_MAX / 4 || g->w > SIZE_MAX / 4) return AC_EINVAL;
  size_t ph = g->h + 2 * g->pad_h, pw = g->w + 2 * g->pad_w;
  if (g->h == 0 || g->w == 0 || ph < g->kh || pw < g->kw) return AC_EINVAL;
  size_t h = (ph - g->kh) / g->stride_h + 1, w = (pw - g->kw) / g->stride_w + 1;
  /* Pool indices are int32 within a plane; col rows * cols must fit. */
  if (!extent_ok(g->h, g->w, 1) || g->h * g->w > (size_t)INT32_MAX) return AC_EINVAL;
  size_t plane, kk;
  if (!mul_ok(h, w, &plane) || !mul_ok(g->kh, g->kw, &kk) || !extent_ok(g->n, g->c, kk) ||
      !extent_ok(g->n * g->c * kk, plane, 1) || !extent_ok(g->n * g->c, g->h * g->w, 1))
    return AC_EINVAL;
  *oh = h;
  *ow = w;
  return AC_OK;
}

/* ------------------------------------------------------------------------------------ */
/* Backends                                                                                */

void ac_backend_opts_default(ac_backend_opts *opts) {
  if (opts == NULL) return;
  opts->kind = AC_BACKEND_CPU;
  opts->threads = 1;
  opts->device = 0;
  opts->cpu_isa = AC_CPU_ISA_BEST;
}

int ac_backend_create(ac_backend **out, const ac_backend_opts *opts) {
  ac_backend_opts def;
  ac_backend *be = NULL;
  int rc = AC_OK;

  if (out == NULL) return AC_EINVAL;
  *out = NULL;
  if (opts == NULL) {
    ac_backend_opts_default(&def);
    opts = &def;
  }
  if (opts->threads < 0 || opts->device < 0) {
    snprintf(last_error, sizeof last_error, "negative threads or device in ac_backend_opts");
    return AC_EINVAL;
  }
  if (opts->cpu_isa < AC_CPU_ISA_BEST || opts->cpu_isa > AC_CPU_ISA_AVX512) {
    snprintf(last_error, sizeof last_error, "unknown cpu_isa %d in ac_backend_opts", opts->cpu_isa);
    return AC_EINVAL;
  }
  be = calloc(1, sizeof *be);
  if (be == NULL) {
    snprintf(last_error, sizeof last_error, "out of host memory");
    return AC_ENOMEM;
  }
  be->kind = opts->kind;
  switch (opts->kind) {
    case AC_BACKEND_CPU:
      rc = ac__cpu_create(be, opts, last_error, sizeof last_error);
      break;
    case AC_BACKEND_CUDA:
#ifdef AC_HAVE_CUDA
      rc = ac__cuda_create(be, opts, last_error, sizeof last_error);
#else
      snprintf(last_error, sizeof last_error,
               "the CUDA backend is not compiled in (configure with -Dcuda=enabled)");
      rc = AC_ENOTSUP;
#endif
      break;
    default:
      snprintf(last_error, sizeof last_error, "unknown backend kind %d", (int)opts->kind);
      rc = AC_EINVAL;
      break;
  }
  if (rc != AC_OK) goto fail;
  snprintf(last_error, sizeof last_error, "%s", be->desc);
  *out = be;
  return AC_OK;

fail:
  free(be);
  return rc;
}

void ac_backend_destroy(ac_backend *be) {
  if (be == NULL) return;
  if (be->ops != NULL) be->ops->destroy(be);
  free(be);
}

ac_backend_kind ac_backend_kind_of(const ac_backend *be) {
  return be != NULL ? be->kind : AC_BACKEND_CPU;
}

const char *ac_backend_name(const ac_backend *be) {
  if (be == NULL) return "none";
  return be->kind == AC_BACKEND_CUDA ? "cuda" : "cpu";
}

const char *ac_backend_describe(const ac_backend *be) {
  return be != NULL ? be->desc : last_error;
}

int ac_sync(ac_backend *be) {
  if (!be_ok(be)) return AC_EINVAL;
  return be->ops->sync(be);
}

/* ------------------------------------------------------------------------------------ */
/* Memory                                                                                  */

int ac_malloc(ac_backend *be, size_t bytes, void **out) {
  if (out == NULL) return AC_EINVAL;
  *out = NULL;
  if (!be_ok(be)) return AC_EINVAL;
  if (bytes == 0) return AC_OK;
  return be->ops->malloc_(be, bytes, out);
}

void ac_free(ac_backend *be, void *p) {
  if (p == NULL || !be_ok(be)) return;
  be->ops->free_(be, p);
}

int ac_memcpy_h2d(ac_backend *be, void *dst, const void *src, size_t bytes) {
  if (!be_ok(be) || !NEED(dst, bytes) || !NEED(src, bytes)) return AC_EINVAL;
  return bytes == 0 ? AC_OK : be->ops->memcpy_h2d(be, dst, src, bytes);
}

int ac_memcpy_d2h(ac_backend *be, void *dst, const void *src, size_t bytes) {
  if (!be_ok(be) || !NEED(dst, bytes) || !NEED(src, bytes)) return AC_EINVAL;
  return bytes == 0 ? be->ops->sync(be) : be->ops->memcpy_d2h(be, dst, src, bytes);
}

int ac_memcpy_d2d(ac_backend *be, void *dst, const void *src, size_t bytes) {
  if (!be_ok(be) || !NEED(dst, bytes) || !NEED(src, bytes)) return AC_EINVAL;
  return bytes == 0 ? AC_OK : be->ops->memcpy_d2d(be, dst, src, bytes);
}

int ac_fill_f32(ac_backend *be, size_t n, float *x, float value) {
  if (!be_ok(be) || !NEED(x, n) || !extent_ok(n, 1, 1)) return AC_EINVAL;
  return n == 0 ? AC_OK : be->ops->fill_f32(be, n, x, value);
}

int ac_fill_i32(ac_backend *be, size_t n, int32_t *x, int32_t value) {
  if (!be_ok(be) || !NEED(x, n) || !extent_ok(n, 1, 1)) return AC_EINVAL;
  return n == 0 ? AC_OK : be->ops->fill_i32(be, n, x, value);
}

int ac_copy2d(ac_backend *be, size_t rows, size_t cols, const float *src, size_t lds, float *dst,
              size_t ldd) {
  if (!be_ok(be) || !matrix_ok(src, rows, cols, lds) || !matrix_ok(dst, rows, cols, ldd))
    return AC_EINVAL;
  if (rows == 0 || cols == 0) return AC_OK;
  return be->ops->copy2d(be, rows, cols, src, lds, dst, ldd);
}

int ac_permute(ac_backend *be, int ndim, const size_t *shape, const int *perm, const float *x,
               float *y) {
  size_t numel = 1;
  int seen[AC_MAX_DIMS] = {0};

  if (!be_ok(be) || ndim < 1 || ndim > AC_MAX_DIMS || shape == NULL || perm == NULL)
    return AC_EINVAL;
  for (int d = 0; d < ndim; d++) {
    if (perm[d] < 0 || perm[d] >= ndim || seen[perm[d]]) return AC_EINVAL;
    seen[perm[d]] = 1;
    if (!mul_ok(numel, shape[d], &numel)) return AC_EINVAL;
  }
  if (!extent_ok(numel, 1, 1) || !NEED(x, numel) || !NEED(y, numel) || (numel > 0 && x == y))
    return AC_EINVAL;
  return numel == 0 ? AC_OK : be->ops->permute(be, ndim, shape, perm, x, y);
}

/* ------------------------------------------------------------------------------------ */
/* Linear algebra                                                                          */

int ac_sgemm_batched(ac_backend *be, ac_trans ta, ac_trans tb, size_t m, size_t n, size_t k,
                     float alpha, const float *a, size_t lda, size_t stride_a, const float *b,
                     size_t ldb, size_t stride_b, float beta, float *c, size_t ldc, size_t stride_c,
                     size_t batch) {
  if (!be_ok(be)) return AC_EINVAL;
  int rc =
      sgemm_check(ta, tb, m, n, k, a, lda, stride_a, b, ldb, stride_b, c, ldc, stride_c, batch);
  if (rc != AC_OK || batch == 0 || m == 0 || n == 0) return rc;
  return be->ops->sgemm_batched(be, ta, tb, m, n, k, alpha, a, lda, stride_a, b, ldb, stride_b,
                                beta, c, ldc, stride_c, batch);
}

int ac_sgemm(ac_backend *be, ac_trans ta, ac_trans tb, size_t m, size_t n, size_t k, float alpha,
             const float *a, size_t lda, const float *b, size_t ldb, float beta, float *c,
             size_t ldc) {
  return ac_sgemm_batched(be, ta, tb, m, n, k, alpha, a, lda, 0, b, ldb, 0, beta, c, ldc, 0, 1);
}

size_t ac_packed_len(size_t n) {
  return n * (n + 1) / 2;
}

int ac_syrk_packed(ac_backend *be, ac_trans trans, size_t n, size_t k, float alpha, const float *a,
                   size_t lda, float beta, float *c_packed) {
  if (!be_ok(be) || !trans_ok(trans) || !extent_ok(n, n, 1)) return AC_EINVAL;
  if (n == 0) return AC_OK;
  if (c_packed == NULL) return AC_EINVAL;
  if (k > 0 && (trans == AC_NO_TRANS ? !matrix_ok(a, n, k, lda) : !matrix_ok(a, k, n, lda)))
    return AC_EINVAL;
  return be->ops->syrk_packed(be, trans, n, k, alpha, a, lda, beta, c_packed);
}

int ac_syrk_packed_to_host(ac_backend *be, ac_trans trans, size_t n, size_t k, float alpha,
                           const float *a, size_t lda, float *host_packed) {
  if (!be_ok(be) || !trans_ok(trans) || !extent_ok(n, n, 1)) return AC_EINVAL;
  if (n == 0) return be->ops->sync(be);
  if (host_packed == NULL) return AC_EINVAL;
  if (k > 0 && (trans == AC_NO_TRANS ? !matrix_ok(a, n, k, lda) : !matrix_ok(a, k, n, lda)))
    return AC_EINVAL;
  return be->ops->syrk_packed_to_host(be, trans, n, k, alpha, a, lda, host_packed);
}

int ac_unpack_sym(ac_backend *be, size_t n, const float *packed, float *dense, size_t ld) {
  if (!be_ok(be) || !matrix_ok(dense, n, n, ld) || !NEED(packed, n)) return AC_EINVAL;
  return n == 0 ? AC_OK : be->ops->unpack_sym(be, n, packed, dense, ld);
}

int ac_pack_sym(ac_backend *be, size_t n, const float *dense, size_t ld, float *packed) {
  if (!be_ok(be) || !matrix_ok(dense, n, n, ld) || !NEED(packed, n)) return AC_EINVAL;
  return n == 0 ? AC_OK : be->ops->pack_sym(be, n, dense, ld, packed);
}

/* ------------------------------------------------------------------------------------ */
/* Elementwise                                                                             */

int ac_binary(ac_backend *be, ac_binary_op op, size_t n, const float *a, const float *b,
              float *out) {
  if (!be_ok(be) || !binary_op_ok(op) || !extent_ok(n, 1, 1) || !NEED(a, n) || !NEED(b, n) ||
      !NEED(out, n))
    return AC_EINVAL;
  return n == 0 ? AC_OK : be->ops->binary(be, op, n, a, b, out);
}

int ac_axpby(ac_backend *be, size_t n, float alpha, const float *x, float beta, const float *y,
             float *out) {
  if (!be_ok(be) || !extent_ok(n, 1, 1) || !NEED(x, n) || !NEED(out, n) ||
      (beta != 0.0f && !NEED(y, n)))
    return AC_EINVAL;
  return n == 0 ? AC_OK : be->ops->axpby(be, n, alpha, x, beta, y, out);
}

int ac_affine(ac_backend *be, size_t n, float alpha, const float *x, float beta, float *out) {
  if (!be_ok(be) || !extent_ok(n, 1, 1) || !NEED(x, n) || !NEED(out, n)) return AC_EINVAL;
  return n == 0 ? AC_OK : be->ops->affine(be, n, alpha, x, beta, out);
}

const char *ac_unary_name(ac_unary_op op) {
  static const char *const names[AC_UNARY_COUNT] = {
      "relu", "gelu",    "exp",    "log", "sqrt", "rsqrt",
      "tanh", "sigmoid", "square", "abs", "neg",  "recip",
  };
  return unary_op_ok(op) ? names[op] : "?";
}

int ac_unary(ac_backend *be, ac_unary_op op, size_t n, const float *x, float *out) {
  if (!be_ok(be) || !unary_op_ok(op) || !extent_ok(n, 1, 1) || !NEED(x, n) || !NEED(out, n))
    return AC_EINVAL;
  return n == 0 ? AC_OK : be->ops->unary(be, op, n, x, out);
}

int ac_unary_backward(ac_backend *be, ac_unary_op op, size_t n, const float *x, const float *dy,
                      float *dx) {
  if (!be_ok(be) || !unary_op_ok(op) || !extent_ok(n, 1, 1) || !NEED(x, n) || !NEED(dy, n) ||
      !NEED(dx, n))
    return AC_EINVAL;
  return n == 0 ? AC_OK : be->ops->unary_backward(be, op, n, x, dy, dx);
}

/* ------------------------------------------------------------------------------------ */
/* Broadcasts and reductions                                                               */

int ac_bcast(ac_backend *be, ac_binary_op op, size_t outer, size_t mid, size_t inner,
             const float *x, const float *v, float *out) {
  if (!be_ok(be) || !binary_op_ok(op) || !extent_ok(outer, mid, inner)) return AC_EINVAL;
  size_t numel = outer * mid * inner;
  if (!NEED(x, numel) || !NEED(out, numel) || !NEED(v, numel > 0 ? mid : 0)) return AC_EINVAL;
  return numel == 0 ? AC_OK : be->ops->bcast(be, op, outer, mid, inner, x, v, out);
}

int ac_reduce(ac_backend *be, ac_reduce_op op, size_t outer, size_t mid, size_t inner, float alpha,
              const float *x, float beta, float *out) {
  if (!be_ok(be) || (int)op < (int)AC_REDUCE_SUM || (int)op > (int)AC_REDUCE_NORM2 ||
      !extent_ok(outer, mid, inner))
    return AC_EINVAL;
  size_t numel = outer * mid * inner;
  if (!NEED(out, mid) || !NEED(x, numel) || (numel > 0 && (const float *)out == x))
    return AC_EINVAL;
  return mid == 0 ? AC_OK : be->ops->reduce(be, op, outer, mid, inner, alpha, x, beta, out);
}

/* A valid backend and (outer, mid, inner) view; *numel its size. */
static int channel_view_ok(ac_backend *be, size_t outer, size_t mid, size_t inner, size_t *numel) {
  if (!be_ok(be) || !extent_ok(outer, mid, inner)) return 0;
  *numel = outer * mid * inner;
  return 1;
}

int ac_channel_moments(ac_backend *be, size_t outer, size_t mid, size_t inner, const float *x,
                       float *mean, float *var) {
  size_t n;
  if (!channel_view_ok(be, outer, mid, inner, &n) || !NEED(x, n) || !NEED(mean, mid) ||
      !NEED(var, mid) ||
      (mid > 0 && (mean == var || (const float *)mean == x || (const float *)var == x)))
    return AC_EINVAL;
  return mid == 0 ? AC_OK : be->ops->channel_moments(be, outer, mid, inner, x, mean, var);
}

int ac_channel_affine(ac_backend *be, size_t outer, size_t mid, size_t inner, const float *x,
                      const float *scale, const float *shift, const float *res, int relu,
                      float *y) {
  size_t n;
  if (!channel_view_ok(be, outer, mid, inner, &n) || !NEED(x, n) || !NEED(y, n) ||
      !NEED(scale, n > 0 ? mid : 0) || !NEED(shift, n > 0 ? mid : 0))
    return AC_EINVAL;
  return n == 0
             ? AC_OK
             : be->ops->channel_affine(be, outer, mid, inner, x, scale, shift, res, relu != 0, y);
}

int ac_channel_grad_sums(ac_backend *be, size_t outer, size_t mid, size_t inner, const float *dy,
                         const float *mask, const float *x, const float *center, float *gout,
                         float *sum_g, float *sum_gx) {
  size_t n;
  if (!channel_view_ok(be, outer, mid, inner, &n) || !NEED(dy, n) || !NEED(x, n) ||
      !NEED(center, mid) || !NEED(sum_g, mid) || !NEED(sum_gx, mid) || (mid > 0 && sum_g == sum_gx))
    return AC_EINVAL;
  return mid == 0 ? AC_OK
                  : be->ops->channel_grad_sums(be, outer, mid, inner, dy, mask, x, center, gout,
                                               sum_g, sum_gx);
}

int ac_channel_combine(ac_backend *be, size_t outer, size_t mid, size_t inner, const float *dy,
                       const float *mask, const float *x, const float *a, const float *b,
                       const float *c, float *dx) {
  size_t n;
  if (!channel_view_ok(be, outer, mid, inner, &n) || !NEED(dy, n) || !NEED(x, n) || !NEED(dx, n) ||
      !NEED(a, n > 0 ? mid : 0))
    return AC_EINVAL;
  return n == 0 ? AC_OK : be->ops->channel_combine(be, outer, mid, inner, dy, mask, x, a, b, c, dx);
}

static int sum_to_host(ac_backend *be, size_t n, const float *x, int squares, double *out) {
  if (out == NULL || !be_ok(be) || !extent_ok(n, 1, 1) || !NEED(x, n)) return AC_EINVAL;
  *out = 0.0;
  return n == 0 ? be->ops->sync(be) : be->ops->sum_to_host(be, n, x, squares, out);
}

int ac_sum_to_host(ac_backend *be, size_t n, const float *x, double *out) {
  return sum_to_host(be, n, x, 0, out);
}

int ac_sumsq_to_host(ac_backend *be, size_t n, const float *x, double *out) {
  return sum_to_host(be, n, x, 1, out);
}

int ac_argmax_rows(ac_backend *be, size_t rows, size_t cols, const float *x, int32_t *idx) {
  if (!be_ok(be) || !extent_ok(rows, cols, 1) || (rows > 0 && cols == 0) ||
      cols > (size_t)INT32_MAX || !NEED(x, rows) || !NEED(idx, rows))
    return AC_EINVAL;
  return rows == 0 ? AC_OK : be->ops->argmax_rows(be, rows, cols, x, idx);
}

int ac_sample_rows(ac_backend *be, size_t rows, size_t cols, const float *probs, const float *u,
                   int32_t *labels) {
  if (!be_ok(be) || !extent_ok(rows, cols, 1) || (rows > 0 && cols == 0) ||
      cols > (size_t)INT32_MAX || !NEED(probs, rows) || !NEED(u, rows) || !NEED(labels, rows))
    return AC_EINVAL;
  return rows == 0 ? AC_OK : be->ops->sample_rows(be, rows, cols, probs, u, labels);
}

/* ------------------------------------------------------------------------------------ */
/* Softmax and cross-entropy                                                               */

static int rows_ok(size_t rows, size_t cols) {
  return extent_ok(rows, cols, 1) && cols <= (size_t)INT32_MAX;
}

int ac_softmax_rows(ac_backend *be, size_t rows, size_t cols, const float *x, float *y) {
  size_t numel = rows * cols;
  if (!be_ok(be) || !rows_ok(rows, cols) || !NEED(x, numel) || !NEED(y, numel)) return AC_EINVAL;
  return numel == 0 ? AC_OK : be->ops->softmax_rows(be, rows, cols, x, y);
}

int ac_softmax_rows_backward(ac_backend *be, size_t rows, size_t cols, const float *y,
                             const float *dy, float *dx) {
  size_t numel = rows * cols;
  if (!be_ok(be) || !rows_ok(rows, cols) || !NEED(y, numel) || !NEED(dy, numel) || !NEED(dx, numel))
    return AC_EINVAL;
  return numel == 0 ? AC_OK : be->ops->softmax_rows_backward(be, rows, cols, y, dy, dx);
}

int ac_mask_causal(ac_backend *be, size_t batch, size_t t, float *x, float value) {
  if (!be_ok(be) || !extent_ok(batch, t, t) || !NEED(x, batch * t)) return AC_EINVAL;
  return batch * t == 0 ? AC_OK : be->ops->mask_causal(be, batch, t, x, value);
}

int ac_xent_forward(ac_backend *be, size_t rows, size_t cols, const float *logits,
                    const int32_t *labels, float *probs, float *loss) {
  size_t numel = rows * cols;
  if (!be_ok(be) || !rows_ok(rows, cols) || (rows > 0 && cols == 0) || !NEED(logits, numel) ||
      !NEED(probs, numel) || !NEED(labels, rows) || !NEED(loss, rows))
    return AC_EINVAL;
  return rows == 0 ? AC_OK : be->ops->xent_forward(be, rows, cols, logits, labels, probs, loss);
}

int ac_xent_backward(ac_backend *be, size_t rows, size_t cols, const float *probs,
                     const int32_t *labels, float scale, float *dlogits) {
  size_t numel = rows * cols;
  if (!be_ok(be) || !rows_ok(rows, cols) || !NEED(probs, numel) ||
      !NEED(labels, numel > 0 ? rows : 0) || !NEED(dlogits, numel))
    return AC_EINVAL;
  return numel == 0 ? AC_OK : be->ops->xent_backward(be, rows, cols, probs, labels, scale, dlogits);
}

/* ------------------------------------------------------------------------------------ */
/* Layer normalisation                                                                     */

int ac_layernorm_rows(ac_backend *be, size_t rows, size_t cols, float eps, const float *x,
                      const float *gamma, const float *beta, float *y, float *mean, float *rstd) {
  size_t numel = rows * cols;
  if (!be_ok(be) || !rows_ok(rows, cols) || !(eps > 0.0f) || !isfinite(eps)) return AC_EINVAL;
  if (numel == 0) return AC_OK;
  if (x == NULL || gamma == NULL || y == NULL || mean == NULL || rstd == NULL || mean == rstd)
    return AC_EINVAL;
  return be->ops->layernorm_forward(be, rows, cols, eps, x, gamma, beta, y, mean, rstd);
}

int ac_layernorm_rows_backward(ac_backend *be, size_t rows, size_t cols, const float *x,
                               const float *gamma, const float *mean, const float *rstd,
                               const float *dy, float *dx, float *dgamma, float *dbeta) {
  size_t numel = rows * cols;
  if (!be_ok(be) || !rows_ok(rows, cols)) return AC_EINVAL;
  if (numel == 0) return AC_OK;
  if (x == NULL || gamma == NULL || mean == NULL || rstd == NULL || dy == NULL || dx == NULL ||
      dgamma == NULL || dgamma == dbeta || (const float *)dx == x)
    return AC_EINVAL;
  return be->ops->layernorm_backward(be, rows, cols, x, gamma, mean, rstd, dy, dx, dgamma, dbeta);
}

/* ------------------------------------------------------------------------------------ */
/* Gathers and scatters                                                                    */

int ac_gather_rows(ac_backend *be, size_t n, size_t cols, const float *table, size_t table_rows,
                   const int32_t *idx, float *out) {
  if (!be_ok(be) || !extent_ok(n, cols, 1) || !extent_ok(table_rows, cols, 1) || !NEED(idx, n) ||
      !NEED(out, n * cols) || !NEED(table, table_rows * cols))
    return AC_EINVAL;
  if (n == 0 || cols == 0) return AC_OK;
  return be->ops->gather_rows(be, n, cols, table, table_rows, idx, out);
}

int ac_scatter_add_rows(ac_backend *be, size_t n, size_t cols, const float *src, const int32_t *idx,
                        float *table, size_t table_rows) {
  if (!be_ok(be) || !extent_ok(n, cols, 1) || !extent_ok(table_rows, cols, 1) || !NEED(idx, n) ||
      !NEED(src, n * cols) || !NEED(table, table_rows * cols))
    return AC_EINVAL;
  if (n == 0 || cols == 0 || table_rows == 0) return AC_OK;
  return be->ops->scatter_add_rows(be, n, cols, src, idx, table, table_rows);
}

/* ------------------------------------------------------------------------------------ */
/* Convolution and pooling                                                                 */

int ac_conv2d_out_hw(const ac_conv2d_geom *g, size_t *oh, size_t *ow) {
  size_t h, w;
  if (oh == NULL || ow == NULL) return AC_EINVAL;
  int rc = geom_check(g, &h, &w);
  if (rc != AC_OK) return rc;
  *oh = h;
  *ow = w;
  return AC_OK;
}

static int im2col(ac_backend *be, const ac_conv2d_geom *g, int merged, const float *x, float *col) {
  size_t oh, ow;
  if (!be_ok(be) || geom_check(g, &oh, &ow) != AC_OK) return AC_EINVAL;
  if (g->n == 0 || g->c == 0) return AC_OK;
  if (x == NULL || col == NULL || (const float *)col == x) return AC_EINVAL;
  return be->ops->im2col(be, g, oh, ow, merged, x, col);
}

static int col2im(ac_backend *be, const ac_conv2d_geom *g, int merged, const float *col, float *x) {
  size_t oh, ow;
  if (!be_ok(be) || geom_check(g, &oh, &ow) != AC_OK) return AC_EINVAL;
  if (g->n == 0 || g->c == 0) return AC_OK;
  if (x == NULL || col == NULL || (const float *)x == col) return AC_EINVAL;
  return be->ops->col2im(be, g, oh, ow, merged, col, x);
}

int ac_im2col(ac_backend *be, const ac_conv2d_geom *g, const float *x, float *col) {
  return im2col(be, g, 0, x, col);
}

int ac_col2im(ac_backend *be, const ac_conv2d_geom *g, const float *col, float *x) {
  return col2im(be, g, 0, col, x);
}

int ac_im2col_batch(ac_backend *be, const ac_conv2d_geom *g, const float *x, float *col) {
  return im2col(be, g, 1, x, col);
}

int ac_col2im_batch(ac_backend *be, const ac_conv2d_geom *g, const float *col, float *x) {
  return col2im(be, g, 1, col, x);
}

int ac_conv3x3_supported(ac_backend *be, size_t c, size_t oc) {
  return be_ok(be) && c > 0 && oc > 0 && be->ops->conv3x3_ok != NULL &&
         be->ops->conv3x3_ok(be, c, oc);
}

/* Shared checks of ac_conv3x3 and its weight gradient: AC_OK to go on, 1 for nothing to do. */
static int conv3x3_check(ac_backend *be, size_t n, size_t c, size_t oc, size_t h, size_t w,
                         const float *in, const float *wt, const float *out) {
  if (!be_ok(be)) return AC_EINVAL;
  if (n == 0 || c == 0 || oc == 0 || h == 0 || w == 0) return 1;
  if (in == NULL || wt == NULL || out == NULL || out == in || out == wt) return AC_EINVAL;
  if (!extent_ok(n, c, h) || !extent_ok(n * c * h, w, 1) || !extent_ok(n, oc, h) ||
      !extent_ok(n * oc * h, w, 1) || !extent_ok(oc, c, 9))
    return AC_EINVAL;
  return ac_conv3x3_supported(be, c, oc) ? AC_OK : AC_ENOTSUP;
}

int ac_conv3x3(ac_backend *be, size_t n, size_t c, size_t oc, size_t h, size_t w, const float *x,
               const float *wt, float *y) {
  int rc = conv3x3_check(be, n, c, oc, h, w, x, wt, y);
  return rc != AC_OK ? (rc == 1 ? AC_OK : rc)
                     : be->ops->conv3x3(be, n, c, oc, h, w, x, wt, NULL, y, NULL);
}

int ac_conv3x3_add(ac_backend *be, size_t n, size_t c, size_t oc, size_t h, size_t w,
                   const float *x, const float *wt, const float *res, float *y) {
  int rc = conv3x3_check(be, n, c, oc, h, w, x, wt, y);
  if (rc == AC_OK && res == NULL) rc = AC_EINVAL;
  return rc != AC_OK ? (rc == 1 ? AC_OK : rc)
                     : be->ops->conv3x3(be, n, c, oc, h, w, x, wt, res, y, NULL);
}

/* moments is written, so it must be none of the other buffers. */
static int moments_ok(const float *moments, const float *x, const float *wt, const float *y) {
  return moments != NULL && moments != x && moments != wt && moments != y;
}

int ac_conv3x3_moments(ac_backend *be, size_t n, size_t c, size_t oc, size_t h, size_t w,
                       const float *x, const float *wt, float *y, float *moments) {
  int rc = conv3x3_check(be, n, c, oc, h, w, x, wt, y);
  if (rc == AC_OK && !moments_ok(moments, x, wt, y)) rc = AC_EINVAL;
  return rc != AC_OK ? (rc == 1 ? AC_OK : rc)
                     : be->ops->conv3x3(be, n, c, oc, h, w, x, wt, NULL, y, moments);
}

/* The batch norm of a conv's input gradient y (ac_bn_grad_args): given, and its sums alias
 * nothing read or written. */
static int bn_grad_ok(const ac_bn_grad_args *bn, const float *x, const float *wt, const float *res,
                      const float *y) {
  return bn != NULL && bn->x != NULL && bn->center != NULL && bn->x != y && bn->mask != y &&
         moments_ok(bn->sums, x, wt, y) && bn->sums != res && bn->sums != bn->x &&
         bn->sums != bn->mask && bn->sums != bn->center;
}

int ac_conv3x3_bn_grad(ac_backend *be, size_t n, size_t c, size_t oc, size_t h, size_t w,
                       const float *x, const float *wt, const float *res, float *y,
                       const ac_bn_grad_args *bn) {
  int rc = conv3x3_check(be, n, c, oc, h, w, x, wt, y);
  if (rc == AC_OK && !bn_grad_ok(bn, x, wt, res, y)) rc = AC_EINVAL;
  if (rc == AC_OK && be->ops->conv3x3_bn_grad == NULL) rc = AC_ENOTSUP;
  return rc != AC_OK ? (rc == 1 ? AC_OK : rc)
                     : be->ops->conv3x3_bn_grad(be, n, c, oc, h, w, x, wt, res, y, bn);
}

int ac_conv3x3_wgrad(ac_backend *be, size_t n, size_t c, size_t oc, size_t h, size_t w,
                     const float *x, const float *dy, float *dw) {
  int rc = conv3x3_check(be, n, c, oc, h, w, x, dy, dw);
  if (rc == AC_OK && dy == x) rc = AC_EINVAL;
  return rc != AC_OK ? (rc == 1 ? AC_OK : rc)
                     : be->ops->conv3x3_wgrad(be, n, c, oc, h, w, x, dy, dw);
}

int ac_conv_s2_supported(ac_backend *be, size_t c, size_t oc, size_t h, size_t w, size_t k) {
  return be_ok(be) && c > 0 && oc > 0 && h > 0 && w > 0 && be->ops->conv_s2_ok != NULL &&
         be->ops->conv_s2_ok(be, c, oc, h, w, k);
}

/* Shared checks of the stride-2 convs (in: what is read besides the weights, out: what is
 * written): AC_OK to go on, 1 for nothing to do. */
static int conv_s2_check(ac_backend *be, size_t n, size_t c, size_t oc, size_t h, size_t w,
                         size_t k, const float *in, const float *wt, const float *out) {
  if (!be_ok(be)) return AC_EINVAL;
  if (n == 0 || c == 0 || oc == 0 || h == 0 || w == 0) return 1;
  if (in == NULL || wt == NULL || out == NULL || out == in || out == wt) return AC_EINVAL;
  if (!extent_ok(n, c, h) || !extent_ok(n * c * h, w, 1) || !extent_ok(n, oc, h) ||
      !extent_ok(n * oc * h, w, 1) || !extent_ok(oc, c, k * k))
    return AC_EINVAL;
  return ac_conv_s2_supported(be, c, oc, h, w, k) ? AC_OK : AC_ENOTSUP;
}

int ac_conv_s2(ac_backend *be, size_t n, size_t c, size_t oc, size_t h, size_t w, size_t k,
               const float *x, const float *wt, float *y) {
  int rc = conv_s2_check(be, n, c, oc, h, w, k, x, wt, y);
  return rc != AC_OK ? (rc == 1 ? AC_OK : rc)
                     : be->ops->conv_s2(be, n, c, oc, h, w, k, x, wt, y, NULL);
}

int ac_conv_s2_moments(ac_backend *be, size_t n, size_t c, size_t oc, size_t h, size_t w, size_t k,
                       const float *x, const float *wt, float *y, float *moments) {
  int rc = conv_s2_check(be, n, c, oc, h, w, k, x, wt, y);
  if (rc == AC_OK && !moments_ok(moments, x, wt, y)) rc = AC_EINVAL;
  return rc != AC_OK ? (rc == 1 ? AC_OK : rc)
                     : be->ops->conv_s2(be, n, c, oc, h, w, k, x, wt, y, moments);
}

int ac_conv_s2_wgrad(ac_backend *be, size_t n, size_t c, size_t oc, size_t h, size_t w, size_t k,
                     const float *x, const float *dy, float *dw) {
  int rc = conv_s2_check(be, n, c, oc, h, w, k, x, dy, dw);
  if (rc == AC_OK && dy == x) rc = AC_EINVAL;
  return rc != AC_OK ? (rc == 1 ? AC_OK : rc)
                     : be->ops->conv_s2_wgrad(be, n, c, oc, h, w, k, x, dy, dw);
}

int ac_conv_s2_dgrad_bn(ac_backend *be, size_t n, size_t c, size_t oc, size_t h, size_t w, size_t k,
                        const float *dy, const float *wt, const float *res, float *dx,
                        const ac_bn_grad_args *bn) {
  int rc = conv_s2_check(be, n, c, oc, h, w, k, dy, wt, dx);
  if (rc == AC_OK && (!bn_grad_ok(bn, dy, wt, res, dx) || res == dx)) rc = AC_EINVAL;
  if (rc == AC_OK && be->ops->conv_s2_dgrad_bn == NULL) rc = AC_ENOTSUP;
  return rc != AC_OK ? (rc == 1 ? AC_OK : rc)
                     : be->ops->conv_s2_dgrad_bn(be, n, c, oc, h, w, k, dy, wt, res, dx, bn);
}

int ac_conv_s2_dgrad(ac_backend *be, size_t n, size_t c, size_t oc, size_t h, size_t w, size_t k,
                     const float *dy, const float *wt, float *dx) {
  int rc = conv_s2_check(be, n, c, oc, h, w, k, dy, wt, dx);
  return rc != AC_OK ? (rc == 1 ? AC_OK : rc)
                     : be->ops->conv_s2_dgrad(be, n, c, oc, h, w, k, dy, wt, dx);
}

int ac_pool2d_forward(ac_backend *be, ac_pool_op op, const ac_conv2d_geom *g, const float *x,
                      float *y, int32_t *argmax) {
  size_t oh, ow;
  if (!be_ok(be) || (op != AC_POOL_MAX && op != AC_POOL_AVG) || geom_check(g, &oh, &ow) != AC_OK)
    return AC_EINVAL;
  if (g->n == 0 || g->c == 0) return AC_OK;
  if (x == NULL || y == NULL || (const float *)y == x) return AC_EINVAL;
  return be->ops->pool2d_forward(be, op, g, oh, ow, x, y, op == AC_POOL_MAX ? argmax : NULL);
}

int ac_pool2d_backward(ac_backend *be, ac_pool_op op, const ac_conv2d_geom *g, const float *dy,
                       const int32_t *argmax, float *dx) {
  size_t oh, ow;
  if (!be_ok(be) || (op != AC_POOL_MAX && op != AC_POOL_AVG) || geom_check(g, &oh, &ow) != AC_OK)
    return AC_EINVAL;
  if (g->n == 0 || g->c == 0) return AC_OK;
  if (dy == NULL || dx == NULL || (const float *)dx == dy || (op == AC_POOL_MAX && argmax == NULL))
    return AC_EINVAL;
  return be->ops->pool2d_backward(be, op, g, oh, ow, dy, argmax, dx);
}

/* ------------------------------------------------------------------------------------ */
/* Random numbers                                                                          */

int ac_rand_uniform(ac_backend *be, uint64_t seed, uint64_t offset, size_t n, float lo, float hi,
                    float *out) {
  if (!be_ok(be) || !extent_ok(n, 1, 1) || !NEED(out, n) || !isfinite(lo) || !isfinite(hi))
    return AC_EINVAL;
  return n == 0 ? AC_OK : be->ops->rand(be, AC__RAND_UNIFORM, seed, offset, n, lo, hi, out);
}

int ac_rand_normal(ac_backend *be, uint64_t seed, uint64_t offset, size_t n, float mean, float std,
                   float *out) {
  if (!be_ok(be) || !extent_ok(n, 1, 1) || !NEED(out, n) || !isfinite(mean) || !isfinite(std) ||
      std < 0.0f)
    return AC_EINVAL;
  return n == 0 ? AC_OK : be->ops->rand(be, AC__RAND_NORMAL, seed, offset, n, mean, std, out);
}

int ac_dropout_mask(ac_backend *be, uint64_t seed, uint64_t offset, size_t n, float p,
                    float *mask) {
  if (!be_ok(be) || !extent_ok(n, 1, 1) || !NEED(mask, n) || !(p >= 0.0f && p < 1.0f))
    return AC_EINVAL;
  return n == 0 ? AC_OK : be->ops->rand(be, AC__RAND_DROPOUT, seed, offset, n, p, 0.0f, mask);
}

/* ------------------------------------------------------------------------------------ */
/* Optimizer                                                                               */

int ac_adamw_update(ac_backend *be, size_t n, float *p, const float *g, float *m, float *v,
                    const ac_adamw_args *args) {
  if (!be_ok(be) || args == NULL || !extent_ok(n, 1, 1) || !NEED(p, n) || !NEED(g, n) ||
      !NEED(m, n) || !NEED(v, n))
    return AC_EINVAL;
  if (!(args->beta1 >= 0.0f && args->beta1 < 1.0f) ||
      !(args->beta2 >= 0.0f && args->beta2 < 1.0f) || !(args->eps > 0.0f) || !isfinite(args->lr) ||
      !isfinite(args->weight_decay) || args->step < 1)
    return AC_EINVAL;
  if (n > 0 && ((const float *)p == g || p == m || p == v || m == v || (const float *)m == g ||
                (const float *)v == g))
    return AC_EINVAL;
  if (n == 0) return AC_OK;
  float bc1 = (float)(1.0 - pow(args->beta1, (double)args->step));
  float bc2 = (float)(1.0 - pow(args->beta2, (double)args->step));
  if (!(bc1 > 0.0f) || !(bc2 > 0.0f))
    return AC_EINVAL; /* beta == 0 is fine (bc = 1); this catches underflow to 0 only */
  return be->ops->adamw_update(be, n, p, g, m, v, args->lr, args->beta1, args->beta2, args->eps,
                               args->weight_decay, bc1, bc2);
}

int ac_moment_graft(ac_backend *be, size_t n, const float *g, float *f, float *v, float *x,
                    float *d, const ac_moment_graft_args *args) {
  if (!be_ok(be) || args == NULL || !extent_ok(n, 1, 1) || !NEED(g, n) || !NEED(f, n) ||
      !NEED(v, n) || !NEED(x, n) || !NEED(d, n))
    return AC_EINVAL;
  const float k[] = {args->f_new, args->f_keep, args->x_g,     args->x_f,
                     args->v_new, args->v_keep, args->v_scale, args->eps};
  for (size_t i = 0; i < sizeof k / sizeof k[0]; i++)
    if (!isfinite(k[i])) return AC_EINVAL;
  if (!(args->eps > 0.0f)) return AC_EINVAL;
  const float *bufs[] = {g, f, v, x, d};
  for (size_t i = 0; n > 0 && i < 5; i++)
    for (size_t j = i + 1; j < 5; j++)
      if (bufs[i] == bufs[j]) return AC_EINVAL;
  return n == 0 ? AC_OK : be->ops->moment_graft(be, n, g, f, v, x, d, args);
}
