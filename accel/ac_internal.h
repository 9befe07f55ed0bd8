/*
 * ac_internal.h -- what the backends of accel share; outside code must not include it.
 *
 * A backend is a table of kernels (ac__ops). backend.c checks every argument once and then
 * calls the table, so a kernel may assume valid arguments and reads like the loop it
 * implements. Adding a backend means filling one ac__ops and one create function (see
 * docs/accel.md).
 */
#ifndef PRECOND_AC_INTERNAL_H
#define PRECOND_AC_INTERNAL_H

#include <math.h>

#include "backend.h"

#ifdef __cplusplus
extern "C" {
#endif

#ifdef __CUDACC__
#define AC__HD static __host__ __device__ __forceinline__
#else
#define AC__HD static inline
#endif

typedef struct ac__ops {
  void (*destroy)(ac_backend *be);
  int (*sync)(ac_backend *be);
  int (*malloc_)(ac_backend *be, size_t bytes, void **out);
  void (*free_)(ac_backend *be, void *p);
  int (*memcpy_h2d)(ac_backend *be, void *dst, const void *src, size_t bytes);
  int (*memcpy_d2h)(ac_backend *be, void *dst, const void *src, size_t bytes);
  int (*memcpy_d2d)(ac_backend *be, void *dst, const void *src, size_t bytes);
  int (*fill_f32)(ac_backend *be, size_t n, float *x, float value);
  int (*fill_i32)(ac_backend *be, size_t n, int32_t *x, int32_t value);
  int (*copy2d)(ac_backend *be, size_t rows, size_t cols, const float *src, size_t lds, float *dst,
                size_t ldd);
  int (*permute)(ac_backend *be, int ndim, const size_t *shape, const int *perm, const float *x,
                 float *y);
  int (*sgemm_batched)(ac_backend *be, ac_trans ta, ac_trans tb, size_t m, size_t n, size_t k,
                       float alpha, const float *a, size_t lda, size_t stride_a, const float *b,
                       size_t ldb, size_t stride_b, float beta, float *c, size_t ldc,
                       size_t stride_c, size_t batch);
  int (*syrk_packed)(ac_backend *be, ac_trans trans, size_t n, size_t k, float alpha,
                     const float *a, size_t lda, float beta, float *c_packed);
  int (*syrk_packed_to_host)(ac_backend *be, ac_trans trans, size_t n, size_t k, float alpha,
                             const float *a, size_t lda, float *host_packed);
  int (*unpack_sym)(ac_backend *be, size_t n, const float *packed, float *dense, size_t ld);
  int (*pack_sym)(ac_backend *be, size_t n, const float *dense, size_t ld, float *packed);
  int (*binary)(ac_backend *be, ac_binary_op op, size_t n, const float *a, const float *b,
                float *out);
  int (*axpby)(ac_backend *be, size_t n, float alpha, const float *x, float beta, const float *y,
               float *out);
  int (*affine)(ac_backend *be, size_t n, float alpha, const float *x, float beta, float *out);
  int (*unary)(ac_backend *be, ac_unary_op op, size_t n, const float *x, float *out);
  int (*unary_backward)(ac_backend *be, ac_unary_op op, size_t n, const float *x, const float *dy,
                        float *dx);
  int (*bcast)(ac_backend *be, ac_binary_op op, size_t outer, size_t mid, size_t inner,
               const float *x, const float *v, float *out);
  int (*reduce)(ac_backend *be, ac_reduce_op op, size_t outer, size_t mid, size_t inner,
                float alpha, const float *x, float beta, float *out);
  int (*channel_moments)(ac_backend *be, size_t outer, size_t mid, size_t inner, const float *x,
                         float *mean, float *var);
  int (*channel_affine)(ac_backend *be, size_t outer, size_t mid, size_t inner, const float *x,
                        const float *scale, const float *shift, const float *res, int relu,
                        float *y);
  int (*channel_grad_sums)(ac_backend *be, size_t outer, size_t mid, size_t inner, const float *dy,
                           const float *mask, const float *x, const float *center, float *gout,
                           float *sum_g, float *sum_gx);
  int (*channel_combine)(ac_backend *be, size_t outer, size_t mid, size_t inner, const float *dy,
                         const float *mask, const float *x, const float *a, const float *b,
                         const float *c, float *dx);
  int (*sum_to_host)(ac_backend *be, size_t n, const float *x, int squares, double *out);
  int (*argmax_rows)(ac_backend *be, size_t rows, size_t cols, const float *x, int32_t *idx);
  int (*sample_rows)(ac_backend *be, size_t rows, size_t cols, const float *probs, const float *u,
                     int32_t *labels);
  int (*softmax_rows)(ac_backend *be, size_t rows, size_t cols, const float *x, float *y);
  int (*softmax_rows_backward)(ac_backend *be, size_t rows, size_t cols, const float *y,
                               const float *dy, float *dx);
  int (*mask_causal)(ac_backend *be, size_t batch, size_t t, float *x, float value);
  int (*xent_forward)(ac_backend *be, size_t rows, size_t cols, const float *logits,
                      const int32_t *labels, float *probs, float *loss);
  int (*xent_backward)(ac_backend *be, size_t rows, size_t cols, const float *probs,
                       const int32_t *labels, float scale, float *dlogits);
  int (*layernorm_forward)(ac_backend *be, size_t rows, size_t cols, float eps, const float *x,
                           const float *gamma, const float *beta, float *y, float *mean,
                           float *rstd);
  int (*layernorm_backward)(ac_backend *be, size_t rows, size_t cols, const float *x,
                            const float *gamma, const float *mean, const float *rstd,
                            const float *dy, float *dx, float *dgamma, float *dbeta);
  int (*gather_rows)(ac_backend *be, size_t n, size_t cols, const float *table, size_t table_rows,
                     const int32_t *idx, float *out);
  int (*scatter_add_rows)(ac_backend *be, size_t n, size_t cols, const float *src,
                          const int32_t *idx, float *table, size_t table_rows);
  /* merged 0: ac_im2col's (n, ckk, ohw) layout; 1: ac_im2col_batch's (ckk, n ohw). */
  int (*im2col)(ac_backend *be, const ac_conv2d_geom *g, size_t oh, size_t ow, int merged,
                const float *x, float *col);
  int (*col2im)(ac_backend *be, const ac_conv2d_geom *g, size_t oh, size_t ow, int merged,
                const float *col, float *x);
  int (*pool2d_forward)(ac_backend *be, ac_pool_op op, const ac_conv2d_geom *g, size_t oh,
                        size_t ow, const float *x, float *y, int32_t *argmax);
  int (*pool2d_backward)(ac_backend *be, ac_pool_op op, const ac_conv2d_geom *g, size_t oh,
                         size_t ow, const float *dy, const int32_t *argmax, float *dx);
  int (*rand)(ac_backend *be, int dist, uint64_t seed, uint64_t offset, size_t n, float a, float b,
              float *out);
  int (*adamw_update)(ac_backend *be, size_t n, float *p, const float *g, float *m, float *v,
                      float lr, float beta1, float beta2, float eps, float wd, float bc1,
                      float bc2);
  int (*moment_graft)(ac_backend *be, size_t n, const float *g, float *f, float *v, float *x,
                      float *d, const ac_moment_graft_args *a);
  /* Optional (NULL: AC_ENOTSUP, the layers use im2col + gemm): direct 3x3 convs. */
  int (*conv3x3_ok)(ac_backend *be, size_t c, size_t oc);
  /* res: NULL, or added to y (ac_conv3x3_add); moments: NULL, or 2 oc floats for the
   * output's batch-norm moments (ac_conv3x3_moments) */
  int (*conv3x3)(ac_backend *be, size_t n, size_t c, size_t oc, size_t h, size_t w, const float *x,
                 const float *wt, const float *res, float *y, float *moments);
  /* Optional (NULL: AC_ENOTSUP): ac_conv3x3_bn_grad. */
  int (*conv3x3_bn_grad)(ac_backend *be, size_t n, size_t c, size_t oc, size_t h, size_t w,
                         const float *x, const float *wt, const float *res, float *y,
                         const ac_bn_grad_args *bn);
  int (*conv3x3_wgrad)(ac_backend *be, size_t n, size_t c, size_t oc, size_t h, size_t w,
                       const float *x, const float *dy, float *dw);
  /* Optional (NULL: AC_ENOTSUP, the layers use im2col + gemm): direct stride-2 convs. */
  int (*conv_s2_ok)(ac_backend *be, size_t c, size_t oc, size_t h, size_t w, size_t k);
  int (*conv_s2)(ac_backend *be, size_t n, size_t c, size_t oc, size_t h, size_t w, size_t k,
                 const float *x, const float *wt, float *y, float *moments);
  int (*conv_s2_wgrad)(ac_backend *be, size_t n, size_t c, size_t oc, size_t h, size_t w, size_t k,
                       const float *x, const float *dy, float *dw);
  /* Optional (NULL: AC_ENOTSUP): ac_conv_s2_dgrad_bn. */
  int (*conv_s2_dgrad_bn)(ac_backend *be, size_t n, size_t c, size_t oc, size_t h, size_t w,
                          size_t k, const float *dy, const float *wt, const float *res, float *dx,
                          const ac_bn_grad_args *bn);
  int (*conv_s2_dgrad)(ac_backend *be, size_t n, size_t c, size_t oc, size_t h, size_t w, size_t k,
                       const float *dy, const float *wt, float *dx);
} ac__ops;

/* Distributions of ac__ops.rand: (a, b) are (lo, hi), (mean, std) or (p, unused). */
enum { AC__RAND_UNIFORM = 0, AC__RAND_NORMAL = 1, AC__RAND_DROPOUT = 2 };

struct ac_backend {
  ac_backend_kind kind;
  const ac__ops *ops;
  void *impl;     /* the backend's own state */
  char desc[192]; /* ac_backend_describe */
};

/* Backend constructors: fill be->ops, be->impl and be->desc. On error they write the reason
 * into err (errlen bytes) and leave be->impl NULL. */
int ac__cpu_create(ac_backend *be, const ac_backend_opts *opts, char *err, size_t errlen);
int ac__cuda_create(ac_backend *be, const ac_backend_opts *opts, char *err, size_t errlen);

/* ------------------------------------------------------------------------------------ */
/* Scalar definitions every backend uses, so that they agree                              */

/* splitmix64 finaliser of seed + (counter + 1) * golden ratio (the counter-based stream). */
AC__HD uint64_t ac__mix64(uint64_t seed, uint64_t counter) {
  uint64_t z = seed + (counter + 1u) * 0x9E3779B97F4A7C15ull;
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

/* The top 24 bits as a float in [0, 1): exact, so bit-identical everywhere. */
AC__HD float ac__u24(uint64_t z) {
  return (float)(z >> 40) * (1.0f / 16777216.0f);
}

/* The low 24 bits as a float in [0, 1). */
AC__HD float ac__v24(uint64_t z) {
  return (float)(z & 0xFFFFFFu) * (1.0f / 16777216.0f);
}

/* Element offset of (i, j), i <= j, in a packed upper triangle of order n. */
AC__HD size_t ac__packed_index(size_t n, size_t i, size_t j) {
  return i * n - i * (i - 1) / 2 + (j - i); /* i = 0: the product is 0, no wrap */
}

/* Rounded products and sums that nvcc must not contract into an fma, so that the CPU
 * (C11 has contraction off) and CUDA produce the same bits. */
#ifdef __CUDA_ARCH__
#define AC__FMUL(a, b) __fmul_rn((a), (b))
#define AC__FADD(a, b) __fadd_rn((a), (b))
#else
#define AC__FMUL(a, b) ((a) * (b))
#define AC__FADD(a, b) ((a) + (b))
#endif

/* Element i of a random call (see accel.h): a uniform on [a, b), a normal (mean a, std b),
 * or an inverted-dropout mask value with drop probability a. */
AC__HD float ac__rand_value(int dist, uint64_t seed, uint64_t counter, float a, float b) {
  uint64_t z = ac__mix64(seed, counter);
  float u = ac__u24(z);
  if (dist == AC__RAND_UNIFORM) return AC__FADD(a, AC__FMUL(b - a, u));
  if (dist == AC__RAND_NORMAL) {
    float r = sqrtf(-2.0f * logf(1.0f - u));
    float c = cosf(6.28318530717958647692f * ac__v24(z));
    return AC__FADD(a, AC__FMUL(b, AC__FMUL(r, c)));
  }
  return u >= a ? 1.0f / (1.0f - a) : 0.0f;
}

AC__HD float ac__binary_value(int op, float a, float b) {
  switch (op) {
    case AC_BIN_ADD:
      return a + b;
    case AC_BIN_SUB:
      return a - b;
    case AC_BIN_MUL:
      return a * b;
    default:
      return a / b;
  }
}

#define AC__GELU_S 0.7978845608028654f /* sqrt(2/pi) */
#define AC__GELU_C 0.044715f

/* tanh through one expf: sign(u) (1 - e) / (1 + e), e = exp(-2|u|). Absolute error a few
 * 1e-8 (relative error grows only as |u| -> 0, where GELU multiplies it by x): it is
 * used for GELU, where libm's tanhf costs several times more than the rest of the op. */
AC__HD float ac__tanh_fast(float u) {
  float e = expf(-2.0f * fabsf(u));
  float t = (1.0f - e) / (1.0f + e);
  return u < 0.0f ? -t : t;
}

/* f(x) of a unary op. */
AC__HD float ac__unary_value(int op, float x) {
  switch (op) {
    case AC_UNARY_RELU:
      return x > 0.0f ? x : 0.0f;
    case AC_UNARY_GELU:
      return 0.5f * x * (1.0f + ac__tanh_fast(AC__GELU_S * (x + AC__GELU_C * x * x * x)));
    case AC_UNARY_EXP:
      return expf(x);
    case AC_UNARY_LOG:
      return logf(x);
    case AC_UNARY_SQRT:
      return sqrtf(x);
    case AC_UNARY_RSQRT:
      return 1.0f / sqrtf(x);
    case AC_UNARY_TANH:
      return tanhf(x);
    case AC_UNARY_SIGMOID:
      return 1.0f / (1.0f + expf(-x));
    case AC_UNARY_SQUARE:
      return x * x;
    case AC_UNARY_ABS:
      return fabsf(x);
    case AC_UNARY_NEG:
      return -x;
    default:
      return 1.0f / x; /* AC_UNARY_RECIP */
  }
}

/* f'(x) of a unary op. */
AC__HD float ac__unary_deriv(int op, float x) {
  switch (op) {
    case AC_UNARY_RELU:
      return x > 0.0f ? 1.0f : 0.0f;
    case AC_UNARY_GELU: {
      float t = ac__tanh_fast(AC__GELU_S * (x + AC__GELU_C * x * x * x));
      return 0.5f * (1.0f + t) +
             0.5f * x * (1.0f - t * t) * AC__GELU_S * (1.0f + 3.0f * AC__GELU_C * x * x);
    }
    case AC_UNARY_EXP:
      return expf(x);
    case AC_UNARY_LOG:
      return 1.0f / x;
    case AC_UNARY_SQRT:
      return 0.5f / sqrtf(x);
    case AC_UNARY_RSQRT:
      return -0.5f / (x * sqrtf(x));
    case AC_UNARY_TANH: {
      float t = tanhf(x);
      return 1.0f - t * t;
    }
    case AC_UNARY_SIGMOID: {
      float s = 1.0f / (1.0f + expf(-x));
      return s * (1.0f - s);
    }
    case AC_UNARY_SQUARE:
      return 2.0f * x;
    case AC_UNARY_ABS:
      return x > 0.0f ? 1.0f : (x < 0.0f ? -1.0f : 0.0f);
    case AC_UNARY_NEG:
      return -1.0f;
    default:
      return -1.0f / (x * x); /* AC_UNARY_RECIP */
  }
}

#ifdef __cplusplus
}
#endif

#endif /* PRECOND_AC_INTERNAL_H */
