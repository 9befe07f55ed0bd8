/*
 * accel.h -- the worker runtime's backend interface: the one public header of accel/.
 *
 * A backend is an accelerator (a CUDA GPU, or the CPU on OpenBLAS) that holds device memory
 * and runs a fixed set of primitives on it. Layers and optimizers are written once against
 * these primitives and run unchanged on every backend. Public names carry the prefix ac_;
 * internal ones live in .c/.cu files as statics or with the prefix ac__ (ac_internal.h, which
 * outside code must not include).
 *
 * Conventions (they hold for every primitive unless its comment says otherwise)
 * - Device pointers. Every float / int32_t pointer argument of a primitive is a DEVICE pointer
 *   obtained from ac_malloc (or ac_tensor) of the same backend, possibly offset. The host must
 *   not dereference it (on the CPU backend it happens to be host memory; do not rely on it).
 *   Only the ac_memcpy_* / *_to_host functions take host pointers, and say so.
 * - Layouts. Dense matrices are row-major with an explicit leading dimension (row stride, in
 *   elements, >= the number of columns). Tensors are C-contiguous; images are NCHW.
 *   A symmetric n x n matrix in "packed upper" form is its upper triangle row by row:
 *   a[0][0..n-1], a[1][1..n-1], ..., a[n-1][n-1], n(n+1)/2 values, element (i, j), i <= j,
 *   at i*n - i*(i-1)/2 + (j - i): the layout of pc_pack_f32 in preconditioner/preconditioner.h.
 * - Ordering. Primitives are issued in order on the backend's one stream and may run
 *   asynchronously: a primitive sees the results of every primitive issued before it.
 *   ac_memcpy_d2h, the *_to_host reductions and ac_sync wait for all earlier work.
 * - Aliasing. Elementwise primitives allow an output to be exactly the same buffer as an input
 *   (in-place); partial overlaps are undefined. Primitives that say "no aliasing" need
 *   disjoint buffers.
 * - beta == 0 means "overwrite": the output is not read (NaN or garbage in it is ignored).
 * - Sizes of zero are valid and do nothing (a reduction of zero elements gives 0).
 * - Returns. Every function returns int: AC_OK (0) or a negative AC_E* code; ac_strerror
 *   turns any code into a static message. Arguments are checked before anything is issued:
 *   on AC_EINVAL nothing was done. Device-side data errors that cannot be checked on the
 *   host (an index out of range inside an index buffer) have defined, documented results
 *   and never touch memory outside the buffers.
 * - Ownership. The caller owns every buffer it passes. ac_malloc/ac_free and the
 *   ac_tensor/ac_param init/destroy pairs are the only functions that allocate or free
 *   user-visible memory; a primitive that needs scratch memory manages it itself.
 * - Threads. A backend is not thread-safe: use one backend from one thread at a time.
 */
#ifndef PRECOND_ACCEL_H
#define PRECOND_ACCEL_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* ------------------------------------------------------------------------------------ */
/* Status codes                                                                           */

enum {
  AC_OK = 0,
  AC_EINVAL = -1,     /* bad argument (null pointer, size, stride, option out of range) */
  AC_ENOMEM = -2,     /* host or device allocation failed */
  AC_ENODEV = -3,     /* the backend is compiled in but no usable device exists */
  AC_ENOTSUP = -4,    /* the backend (or feature) is not compiled into this build */
  AC_EDEVICE = -5,    /* the device runtime, driver or a library (cuBLAS) reported an error */
  AC_EMISMATCH = -6   /* objects from different backends, or shapes that do not match */
};

/* Returns a static, human-readable message for a status code. Never returns NULL. */
const char *ac_strerror(int status);

/* ------------------------------------------------------------------------------------ */
/* Backends                                                                               */

typedef enum {
  AC_BACKEND_CPU = 0,   /* host memory, OpenBLAS; always available */
  AC_BACKEND_CUDA = 1   /* one CUDA device, cuBLAS + own kernels; needs -Dcuda and a GPU */
} ac_backend_kind;

typedef struct {
  ac_backend_kind kind;
  /* CPU: OpenBLAS threads (openblas_set_num_threads; process-wide, as OpenBLAS is).
   * 0 leaves OpenBLAS's setting alone. Default 1. Ignored by CUDA. */
  int threads;
  /* CUDA: device ordinal. Default 0. Ignored by CPU. */
  int device;
} ac_backend_opts;

/* Opaque: the backend's state (stream, library handles, scratch). */
typedef struct ac_backend ac_backend;

/* Fills opts with the defaults: CPU, 1 thread, device 0. */
void ac_backend_opts_default(ac_backend_opts *opts);

/* Creates a backend. On AC_OK *out is a new backend the caller owns and frees with
 * ac_backend_destroy; on error *out is NULL. opts may be NULL for the defaults.
 * Errors: AC_ENOTSUP (CUDA not compiled in), AC_ENODEV (no such CUDA device; the message of
 * ac_backend_last_error says why), AC_EDEVICE, AC_ENOMEM. */
int ac_backend_create(ac_backend **out, const ac_backend_opts *opts);

/* Waits for outstanding work and frees the backend. Memory still allocated on it must be
 * freed before (it is not tracked). NULL is a no-op. */
void ac_backend_destroy(ac_backend *be);

ac_backend_kind ac_backend_kind_of(const ac_backend *be);

/* "cpu" or "cuda". Static string. */
const char *ac_backend_name(const ac_backend *be);

/* One line describing the device ("cpu (OpenBLAS, 1 thread)", "cuda:0 NVIDIA H200 ..."),
 * or why creation failed: the static buffer of the last ac_backend_create in this thread is
 * returned when be is NULL. Never returns NULL. */
const char *ac_backend_describe(const ac_backend *be);

/* Waits until every primitive issued so far has finished. Returns AC_EDEVICE if any of them
 * failed on the device (CUDA reports asynchronous errors here). */
int ac_sync(ac_backend *be);

/* ------------------------------------------------------------------------------------ */
/* Device memory                                                                          */

/* Allocates bytes of device memory (aligned to at least 256 bytes) into *out; the caller owns
 * it and frees it with ac_free on the same backend. bytes == 0 gives *out == NULL and AC_OK.
 * Contents are undefined. */
int ac_malloc(ac_backend *be, size_t bytes, void **out);

/* Frees memory from ac_malloc on this backend; waits for work that may still use it.
 * NULL is a no-op. */
void ac_free(ac_backend *be, void *p);

/* Copies bytes from host memory src to device memory dst. Returns after src may be reused. */
int ac_memcpy_h2d(ac_backend *be, void *dst, const void *src, size_t bytes);
/* Copies bytes from device memory src to host memory dst; waits for earlier work and for the
 * copy, so dst is valid on return. */
int ac_memcpy_d2h(ac_backend *be, void *dst, const void *src, size_t bytes);
/* Copies bytes between two device buffers of this backend; no overlap. */
int ac_memcpy_d2d(ac_backend *be, void *dst, const void *src, size_t bytes);

/* x[i] = value for i < n. */
int ac_fill_f32(ac_backend *be, size_t n, float *x, float value);
int ac_fill_i32(ac_backend *be, size_t n, int32_t *x, int32_t value);

/* Strided 2-D copy: dst[i*ldd + j] = src[i*lds + j] for i < rows, j < cols (lds, ldd >= cols).
 * Extracts or inserts a block of a matrix. No aliasing. */
int ac_copy2d(ac_backend *be, size_t rows, size_t cols, const float *src, size_t lds,
              float *dst, size_t ldd);

/* Transpose of a C-contiguous tensor of ndim (1..AC_MAX_DIMS) dimensions shape[]: y has
 * shape y_shape[k] = shape[perm[k]] and y[idx] = x[idx'] where idx'[perm[k]] = idx[k].
 * perm must be a permutation of 0..ndim-1. No aliasing.
 * Example: attention heads, (B, T, 3, H, Dh) with perm {2, 0, 3, 1, 4} -> (3, B, H, T, Dh). */
int ac_permute(ac_backend *be, int ndim, const size_t *shape, const int *perm,
               const float *x, float *y);

/* ------------------------------------------------------------------------------------ */
/* Dense linear algebra                                                                   */

typedef enum { AC_NO_TRANS = 0, AC_TRANS = 1 } ac_trans;

/* Row-major, strided-batched sgemm: for b < batch,
 *   C_b = alpha op(A_b) op(B_b) + beta C_b,  with X_b = X + b * stride_x,
 * op(A_b) is m x k, op(B_b) is k x n, C_b is m x n. A_b is m x k (lda >= k) when ta is
 * AC_NO_TRANS and k x m (lda >= m) when AC_TRANS; likewise B_b is k x n (ldb >= n) or n x k
 * (ldb >= k); ldc >= n. stride_a or stride_b may be 0 (the same matrix for every batch
 * entry, e.g. conv weights); stride_c must be large enough that the C_b do not overlap when
 * batch > 1 (AC_EINVAL otherwise: accumulate across a batch by looping with beta = 1).
 * C must not overlap A or B. k == 0 gives C = beta C. */
int ac_sgemm_batched(ac_backend *be, ac_trans ta, ac_trans tb, size_t m, size_t n, size_t k,
                     float alpha, const float *a, size_t lda, size_t stride_a,
                     const float *b, size_t ldb, size_t stride_b,
                     float beta, float *c, size_t ldc, size_t stride_c, size_t batch);

/* ac_sgemm_batched with batch 1. */
int ac_sgemm(ac_backend *be, ac_trans ta, ac_trans tb, size_t m, size_t n, size_t k,
             float alpha, const float *a, size_t lda, const float *b, size_t ldb,
             float beta, float *c, size_t ldc);

/* Gram matrix into a packed upper triangle (the Shampoo statistics of a block):
 *   trans == AC_NO_TRANS: C = alpha A A^T + beta C, A is n x k (lda >= k): C = G G^T
 *   trans == AC_TRANS:    C = alpha A^T A + beta C, A is k x n (lda >= n): C = G^T G
 * C is n x n symmetric, packed upper (n(n+1)/2 values, ac_packed_len). EMA of statistics:
 * alpha = 1 - beta2, beta = beta2. Block of a larger gradient: a points at its first element
 * with lda the full row stride. No aliasing between A and C. */
int ac_syrk_packed(ac_backend *be, ac_trans trans, size_t n, size_t k, float alpha,
                   const float *a, size_t lda, float beta, float *c_packed);

/* Packed upper (n(n+1)/2) to dense row-major n x n (ld >= n; both triangles written), and
 * dense (upper triangle read) to packed. For preconditioners fetched packed from precondd. */
int ac_unpack_sym(ac_backend *be, size_t n, const float *packed, float *dense, size_t ld);
int ac_pack_sym(ac_backend *be, size_t n, const float *dense, size_t ld, float *packed);

/* n(n+1)/2 (host helper, no backend). */
size_t ac_packed_len(size_t n);

/* ------------------------------------------------------------------------------------ */
/* Elementwise maps (n elements, contiguous; in-place allowed)                            */

typedef enum {
  AC_BIN_ADD = 0,  /* a + b */
  AC_BIN_SUB,      /* a - b */
  AC_BIN_MUL,      /* a * b */
  AC_BIN_DIV       /* a / b (IEEE: x/0 is +-Inf or NaN) */
} ac_binary_op;

/* out[i] = a[i] op b[i]. */
int ac_binary(ac_backend *be, ac_binary_op op, size_t n, const float *a, const float *b,
              float *out);

/* out[i] = alpha x[i] + beta y[i]. axpy: out = y, beta = 1. scale: beta = 0 (y not read,
 * may be NULL). Residual add, gradient accumulation, SGD momentum, Nesterov lookahead. */
int ac_axpby(ac_backend *be, size_t n, float alpha, const float *x, float beta,
             const float *y, float *out);

/* out[i] = alpha x[i] + beta (scalar beta): scale and shift, e.g. var + eps. */
int ac_affine(ac_backend *be, size_t n, float alpha, const float *x, float beta, float *out);

typedef enum {
  AC_UNARY_RELU = 0,  /* max(x, 0);                  d/dx: x > 0 ? 1 : 0 */
  AC_UNARY_GELU,      /* tanh form: 0.5x(1 + tanh(s(x + 0.044715x^3))), s = sqrt(2/pi) */
  AC_UNARY_EXP,       /* e^x */
  AC_UNARY_LOG,       /* ln x */
  AC_UNARY_SQRT,      /* sqrt x */
  AC_UNARY_RSQRT,     /* 1/sqrt x */
  AC_UNARY_TANH,
  AC_UNARY_SIGMOID,   /* 1/(1+e^-x) */
  AC_UNARY_SQUARE,    /* x^2 */
  AC_UNARY_ABS,       /* |x|;                         d/dx: sign(x), 0 at 0 */
  AC_UNARY_NEG,       /* -x */
  AC_UNARY_RECIP,     /* 1/x */
  AC_UNARY_COUNT
} ac_unary_op;

/* Static name of a unary op ("relu", "gelu", ...); "?" for an unknown value. */
const char *ac_unary_name(ac_unary_op op);

/* out[i] = f(x[i]). */
int ac_unary(ac_backend *be, ac_unary_op op, size_t n, const float *x, float *out);

/* Backward of ac_unary: dx[i] = dy[i] f'(x[i]), with x the forward INPUT. dx may alias dy
 * (or x). */
int ac_unary_backward(ac_backend *be, ac_unary_op op, size_t n, const float *x,
                      const float *dy, float *dx);

/* ------------------------------------------------------------------------------------ */
/* Broadcasts and reductions over a 3-axis view (outer, mid, inner) of a contiguous tensor:  */
/* element (o, m, i) is at (o * mid + m) * inner + i. The vector v (or the result) has one */
/* value per mid index. Shapes used by layers:                                             */
/*   Linear bias (rows x cols): (rows, cols, 1)       row statistics (rows x cols): (1, rows, cols) */
/*   batch norm (N, C, H, W): (N, C, H*W)             global avg pool NCHW: (1, N*C, H*W)  */
/*   positional embedding (B, T, D): (B, T*D, 1)                                           */
/* The reduction with the same shape is the gradient of the broadcast with respect to v.  */

/* out[o][m][i] = x[o][m][i] op v[m]. out may alias x. */
int ac_bcast(ac_backend *be, ac_binary_op op, size_t outer, size_t mid, size_t inner,
             const float *x, const float *v, float *out);

typedef enum {
  AC_REDUCE_SUM = 0,  /* sum */
  AC_REDUCE_SUMSQ,    /* sum of squares */
  AC_REDUCE_MAX,      /* maximum (-Inf for an empty set) */
  AC_REDUCE_NORM2     /* sqrt of the sum of squares */
} ac_reduce_op;

/* out[m] = alpha * R_{o,i} x[o][m][i] + beta * out[m], R the reduction op. beta = 0
 * overwrites; beta = 1 accumulates (bias gradients over micro-batches). out has mid values
 * and must not alias x. Accumulation precision and order are backend-specific (CPU: double,
 * CUDA: float per thread, then a tree): results agree across backends to rounding, not
 * bitwise. */
int ac_reduce(ac_backend *be, ac_reduce_op op, size_t outer, size_t mid, size_t inner,
              float alpha, const float *x, float beta, float *out);

/* Per-channel passes of batch normalisation, on the same (outer, mid, inner) view with mid
 * the channel ((N, C, H*W) for images). Each walks the tensor once where the ac_reduce /
 * ac_bcast recipe walks it 3 to 6 times, and folds in the ReLU and residual add that follow
 * a batch norm in a ResNet block. Sums are in double on the CPU (in a fixed order: results
 * do not depend on the thread count), float per thread then a tree on CUDA. */

/* mean[m] and the biased variance var[m] of the outer*inner values of channel m (var from
 * the double sums of x and x^2, clamped at 0). No aliasing. */
int ac_channel_moments(ac_backend *be, size_t outer, size_t mid, size_t inner,
                       const float *x, float *mean, float *var);

/* y = x scale[m] + shift[m] (+ res, when res is not NULL), then max(., 0) when relu != 0:
 * batch norm's output (scale = gamma rstd, shift = beta - mean scale), the residual add and
 * the ReLU in one pass. y may alias x or res. */
int ac_channel_affine(ac_backend *be, size_t outer, size_t mid, size_t inner,
                      const float *x, const float *scale, const float *shift,
                      const float *res, int relu, float *y);

/* The sums of batch norm's backward, with g = dy where mask is NULL or mask > 0, else 0
 * (mask: the output of a fused ReLU): sum_g[m] = sum of g, sum_gx[m] = sum of
 * g (x - center[m]) over channel m; g itself is written to gout when it is not NULL (the
 * gradient a fused residual add hands on). gout may alias dy; nothing else aliases. */
int ac_channel_grad_sums(ac_backend *be, size_t outer, size_t mid, size_t inner,
                         const float *dy, const float *mask, const float *x,
                         const float *center, float *gout, float *sum_g, float *sum_gx);

/* dx = a[m] g + b[m] x + c[m], g masked as in ac_channel_grad_sums (mask may be NULL);
 * b and c may be NULL (zero): batch norm's input gradient in one pass. dx may alias dy or
 * x. */
int ac_channel_combine(ac_backend *be, size_t outer, size_t mid, size_t inner,
                       const float *dy, const float *mask, const float *x, const float *a,
                       const float *b, const float *c, float *dx);

/* Reductions of n contiguous values to a host double (waits for earlier work):
 * sum and sum of squares. For global-norm clipping and grafting norms: a norm is
 * sqrt(sumsq). out is a HOST pointer. */
int ac_sum_to_host(ac_backend *be, size_t n, const float *x, double *out);
int ac_sumsq_to_host(ac_backend *be, size_t n, const float *x, double *out);

/* index of the largest value of each row of x (rows x cols, contiguous) into idx[rows]
 * (device int32; the first index on ties; cols >= 1). For accuracy. */
int ac_argmax_rows(ac_backend *be, size_t rows, size_t cols, const float *x, int32_t *idx);

/* ------------------------------------------------------------------------------------ */
/* Softmax, attention mask, cross-entropy                                                 */

/* Numerically stable softmax of each row: y = exp(x - max) / sum. rows x cols contiguous;
 * y may alias x. A row that is all -Inf gives NaN (never happens under a causal mask). */
int ac_softmax_rows(ac_backend *be, size_t rows, size_t cols, const float *x, float *y);

/* Backward of ac_softmax_rows from its OUTPUT y: dx = y * (dy - sum_j(dy_j y_j)) per row.
 * dx may alias dy. */
int ac_softmax_rows_backward(ac_backend *be, size_t rows, size_t cols, const float *y,
                             const float *dy, float *dx);

/* Causal mask on attention scores x of shape (batch, t, t) (batch = B * heads):
 * x[b][i][j] = value for j > i; other entries unchanged. Use value = -INFINITY before
 * ac_softmax_rows. In place. */
int ac_mask_causal(ac_backend *be, size_t batch, size_t t, float *x, float value);

/* Softmax cross-entropy, forward: probs = softmax(logits) per row (rows x cols) and
 * loss[r] = -log probs[r][labels[r]]. labels (device int32, rows): a label outside
 * [0, cols) (e.g. -1 for padding) marks an ignored row: loss[r] = 0. probs may alias logits.
 * Sum the loss with ac_sum_to_host. */
int ac_xent_forward(ac_backend *be, size_t rows, size_t cols, const float *logits,
                    const int32_t *labels, float *probs, float *loss);

/* Softmax cross-entropy, backward: dlogits[r] = scale * (probs[r] - onehot(labels[r])),
 * zero for ignored rows. scale is usually 1 / (number of counted rows). dlogits may alias
 * probs. */
int ac_xent_backward(ac_backend *be, size_t rows, size_t cols, const float *probs,
                     const int32_t *labels, float scale, float *dlogits);

/* ------------------------------------------------------------------------------------ */
/* Layer normalisation (fused; the same result as the ac_reduce / ac_bcast recipe)         */

/* Each row r of x (rows x cols, contiguous): mean[r], rstd[r] = 1 / sqrt(var + eps) with the
 * biased variance, y = (x - mean) rstd gamma + beta (gamma, beta: cols values each; beta may
 * be NULL for none). mean and rstd (rows values each) are saved for the backward pass.
 * eps > 0. y may alias x. */
int ac_layernorm_rows(ac_backend *be, size_t rows, size_t cols, float eps, const float *x,
                         const float *gamma, const float *beta, float *y, float *mean,
                         float *rstd);

/* Backward of ac_layernorm_rows, with xhat = (x - mean) rstd and g = dy gamma:
 *   dx = rstd (g - mean_cols(g) - xhat mean_cols(g xhat)),
 *   dgamma += sum_rows(dy xhat), dbeta += sum_rows(dy)   (accumulated: zero them first).
 * dbeta may be NULL (no beta). dx may alias dy; nothing else aliases. */
int ac_layernorm_rows_backward(ac_backend *be, size_t rows, size_t cols, const float *x,
                          const float *gamma, const float *mean, const float *rstd,
                          const float *dy, float *dx, float *dgamma, float *dbeta);

/* ------------------------------------------------------------------------------------ */
/* Gathers and scatters (embeddings)                                                      */

/* out[r][:] = table[idx[r]][:] for r < n; table is table_rows x cols, out is n x cols,
 * idx device int32. An index outside [0, table_rows) writes a zero row. No aliasing. */
int ac_gather_rows(ac_backend *be, size_t n, size_t cols, const float *table,
                   size_t table_rows, const int32_t *idx, float *out);

/* table[idx[r]][:] += src[r][:] for r < n (repeated indices add up; order, and therefore
 * rounding, is backend-specific). An index outside [0, table_rows) is skipped. The embedding
 * gradient: zero the table gradient first. No aliasing. */
int ac_scatter_add_rows(ac_backend *be, size_t n, size_t cols, const float *src,
                        const int32_t *idx, float *table, size_t table_rows);

/* ------------------------------------------------------------------------------------ */
/* Convolution and pooling (NCHW)                                                         */

typedef struct {
  size_t n, c, h, w;              /* input batch, channels, height, width */
  size_t kh, kw;                  /* kernel (or pooling window) height and width, >= 1 */
  size_t stride_h, stride_w;      /* >= 1 */
  size_t pad_h, pad_w;            /* zero padding on each side; < kernel size */
} ac_conv2d_geom;

/* Output height and width: (h + 2 pad_h - kh) / stride_h + 1, likewise w. Returns AC_EINVAL
 * (and writes nothing) if the geometry is invalid (zero kernel or stride, pad >= kernel, or a
 * kernel larger than the padded input). Host helper. */
int ac_conv2d_out_hw(const ac_conv2d_geom *g, size_t *oh, size_t *ow);

/* im2col for all n images: col has shape (n, c*kh*kw, oh*ow): for image b, row
 * (ch*kh + p)*kw + q, column y*ow + x holds x_in[b][ch][y*stride_h + p - pad_h][x*stride_w
 * + q - pad_w], or 0 in the padding. Then conv2d forward for weights W (oc x c*kh*kw) is
 * ac_sgemm_batched(NO_TRANS, NO_TRANS, oc, oh*ow, c*kh*kw, 1, W, ckk, 0, col, ohw, ckk*ohw,
 * 0, y, ohw, oc*ohw, n) with y in NCHW. No aliasing. */
int ac_im2col(ac_backend *be, const ac_conv2d_geom *g, const float *x, float *col);

/* The adjoint of ac_im2col: x = sum of col entries that im2col would have read from each
 * input element (padding entries dropped). x (n, c, h, w) is overwritten. The conv2d input
 * gradient from dcol = W^T dy. No aliasing. */
int ac_col2im(ac_backend *be, const ac_conv2d_geom *g, const float *col, float *x);

/* im2col of the n images into ONE column matrix of shape (c*kh*kw, n*oh*ow), so that a
 * batch (or a chunk of images) is one gemm with a long N, not n small ones: row
 * (ch*kh + p)*kw + q, column b*oh*ow + y*ow + x holds the same value as ac_im2col's. Conv2d
 * forward is then ac_sgemm(NO_TRANS, NO_TRANS, oc, n*ohw, ckk, 1, W, ckk, col, n*ohw, 0, t,
 * n*ohw), t in (oc, n, ohw) order, and ac_permute(shape {oc, n, ohw}, perm {1, 0, 2}) gives
 * NCHW (for n == 1 t already is). The layout ac_conv2d uses. No aliasing. */
int ac_im2col_batch(ac_backend *be, const ac_conv2d_geom *g, const float *x, float *col);

/* The adjoint of ac_im2col_batch (as ac_col2im is of ac_im2col). No aliasing. */
int ac_col2im_batch(ac_backend *be, const ac_conv2d_geom *g, const float *col, float *x);

typedef enum { AC_POOL_MAX = 0, AC_POOL_AVG = 1 } ac_pool_op;

/* 2-D pooling of x (n, c, h, w) into y (n, c, oh, ow), window kh x kw, geometry g.
 * MAX: padding never wins; argmax (device int32, n*c*oh*ow, may be NULL for inference)
 * records the winning input index within its (n, c) plane (y_in*w + x_in), first on ties.
 * AVG: the sum over the window divided by kh*kw (padding counts as zeros); argmax unused.
 * Global average pooling is ac_reduce(SUM, 1, n*c, h*w, 1/(h*w)). No aliasing. */
int ac_pool2d_forward(ac_backend *be, ac_pool_op op, const ac_conv2d_geom *g, const float *x,
                      float *y, int32_t *argmax);

/* Backward of ac_pool2d_forward: dx (n, c, h, w) is overwritten with the gradient from dy
 * (n, c, oh, ow). MAX needs the argmax of the forward pass. No aliasing. */
int ac_pool2d_backward(ac_backend *be, ac_pool_op op, const ac_conv2d_geom *g,
                       const float *dy, const int32_t *argmax, float *dx);

/* ------------------------------------------------------------------------------------ */
/* Random numbers: counter-based, so every backend gives the same numbers                  */
/*                                                                                          */
/* Element i of a call uses the counter c = offset + i and the 64-bit splitmix64 finaliser  */
/* of seed + (c + 1) * 0x9E3779B97F4A7C15; u = (z >> 40) * 2^-24 in [0, 1). Integer work    */
/* only, so uniforms (and dropout masks) are bit-identical across backends; normals use    */
/* log/cos and agree to a few ulps. Advance offset by n between calls for fresh numbers.   */

/* out[i] = lo + (hi - lo) u_i. */
int ac_rand_uniform(ac_backend *be, uint64_t seed, uint64_t offset, size_t n, float lo,
                    float hi, float *out);

/* out[i] = mean + std * sqrt(-2 ln(1 - u_i)) cos(2 pi v_i), v_i from the low 24 bits of z. */
int ac_rand_normal(ac_backend *be, uint64_t seed, uint64_t offset, size_t n, float mean,
                   float std, float *out);

/* Inverted dropout mask: mask[i] = u_i >= p ? 1 / (1 - p) : 0, 0 <= p < 1. Then y = x * mask
 * and dx = dy * mask with ac_binary(MUL). */
int ac_dropout_mask(ac_backend *be, uint64_t seed, uint64_t offset, size_t n, float p,
                    float *mask);

/* ------------------------------------------------------------------------------------ */
/* Fused optimizer step                                                                   */

typedef struct {
  float lr;            /* learning rate */
  float beta1, beta2;  /* moment decays, in [0, 1) */
  float eps;           /* > 0 */
  float weight_decay;  /* decoupled (AdamW): p -= lr * wd * p; 0 for Adam */
  long step;           /* 1-based step count, for the bias corrections 1 - beta^step */
} ac_adamw_args;

/* AdamW on n values, in place: m = b1 m + (1-b1) g; v = b2 v + (1-b2) g^2;
 * p -= lr (m / (1 - b1^t) / (sqrt(v / (1 - b2^t)) + eps) + wd p). p, g, m, v distinct. */
int ac_adamw_update(ac_backend *be, size_t n, float *p, const float *g, float *m, float *v,
                    const ac_adamw_args *args);

/* ------------------------------------------------------------------------------------ */
/* Tensors and named parameters                                                           */

#define AC_MAX_DIMS 6

typedef enum { AC_F32 = 0, AC_I32 = 1 } ac_dtype;

/* A device tensor: C-contiguous data of numel elements. Fields are read-only for users;
 * set them with the functions below. */
typedef struct {
  ac_backend *be;               /* the backend holding data (not owned) */
  ac_dtype dtype;
  int ndim;                     /* 0 (scalar: numel 1) .. AC_MAX_DIMS */
  size_t shape[AC_MAX_DIMS];    /* unused entries are 1 */
  size_t numel;
  void *data;                   /* device pointer; NULL when numel == 0 */
  int owns;                     /* 1 if ac_tensor_destroy frees data */
} ac_tensor;

/* Allocates a zero-filled tensor on be (caller-allocated struct t; free with
 * ac_tensor_destroy). On error t is left empty (destroy is still safe). */
int ac_tensor_init(ac_tensor *t, ac_backend *be, ac_dtype dtype, int ndim, const size_t *shape);

/* A view of existing device memory data (not owned: destroy does not free it). */
int ac_tensor_view(ac_tensor *t, ac_backend *be, ac_dtype dtype, int ndim, const size_t *shape,
                   void *data);

/* Frees owned data and empties t. Safe on an empty or already destroyed tensor. */
void ac_tensor_destroy(ac_tensor *t);

/* Typed data accessors (device pointers). NULL if the dtype differs. */
float *ac_tensor_f32(const ac_tensor *t);
int32_t *ac_tensor_i32(const ac_tensor *t);

/* Bytes of data: numel * element size. */
size_t ac_tensor_bytes(const ac_tensor *t);

/* Whole-tensor copies between t and host memory of ac_tensor_bytes(t) bytes. */
int ac_tensor_upload(ac_tensor *t, const void *host);
int ac_tensor_download(const ac_tensor *t, void *host);

/* A trainable parameter: value and gradient of the same shape on one backend, and a name
 * (the name precondd knows the tensor by, e.g. "block3.attn.qkv.weight"). */
typedef struct {
  char *name;         /* owned copy */
  ac_tensor value;    /* f32 */
  ac_tensor grad;     /* f32, same shape; zeroed at init */
} ac_param;

/* Allocates value and grad (both zero) and copies name (non-empty, < 256 bytes). Free with
 * ac_param_destroy; on error p is left empty. */
int ac_param_init(ac_param *p, ac_backend *be, const char *name, int ndim, const size_t *shape);
void ac_param_destroy(ac_param *p);

/* ==================================================================================== */
/* Layers (accel/layers*.c): forward and backward passes written once against the          */
/* primitives above. Owned by the layers team.                                              */

/*
 * Conventions of every layer (docs/layers.md has the long version)
 * - A layer is a caller-allocated struct with _init / _destroy. init allocates the layer's
 *   parameters (ac_param, named "<prefix>.weight", "<prefix>.bias", ...) and its activation
 *   buffers, sized for at most max_rows (or max_batch) inputs; forward may be called with any
 *   smaller count. On an init error the struct is left empty and _destroy is still safe.
 * - Forward: reads x (a device pointer the CALLER owns and must keep unchanged until the
 *   matching backward, because the layer caches the pointer, not a copy), writes its output
 *   into a buffer the LAYER owns and returns it through *y. *y stays valid until the next
 *   forward on the layer or its destroy. Some layers cache more (normalised values, masks).
 * - Backward: after a forward, takes dy (caller-owned, same shape as y), ADDS the parameter
 *   gradients into each ac_param's grad (zero them between steps: ac_param_list_zero_grad),
 *   and returns the input gradient through *dx in a LAYER-owned buffer (valid until the next
 *   backward or destroy). dx may be NULL where the input gradient is not needed (the first
 *   layer): the layer then skips computing it. Some layers return dy itself as *dx
 *   (identity paths: eval-mode dropout, positional embedding, residual add).
 * - Weights are initialised from the counter RNG with the seed given to init, so every
 *   backend starts from the same numbers.
 * - Errors: AC_EINVAL for bad sizes or calls out of order (backward before forward),
 *   otherwise the primitives' codes. A layer is used from one thread, like its backend.
 */

typedef enum { AC_MODE_TRAIN = 0, AC_MODE_EVAL = 1 } ac_mode;

/* A growable list of parameter pointers (not owned): the way layers and models expose
 * their parameters to optimizers, statistics and the client. */
typedef struct {
  ac_param **items;
  size_t n, cap;
} ac_param_list;

void ac_param_list_init(ac_param_list *l);
/* Frees the array only; the parameters belong to their layers. */
void ac_param_list_destroy(ac_param_list *l);
/* Appends p (not copied). AC_ENOMEM on allocation failure (the list is unchanged). */
int ac_param_list_push(ac_param_list *l, ac_param *p);
/* Sets every parameter's grad to zero. */
int ac_param_list_zero_grad(ac_param_list *l);
/* Total number of parameter values. */
size_t ac_param_list_numel(const ac_param_list *l);
/* The parameter with this name, or NULL. */
ac_param *ac_param_list_find(const ac_param_list *l, const char *name);

/* Linear: y = x W^T + b, x (rows, in), W (out, in) "<p>.weight", b (out) "<p>.bias" (when
 * bias != 0). W ~ U(-1/sqrt(in), 1/sqrt(in)), b = 0. */
typedef struct {
  ac_backend *be;
  size_t in, out, max_rows, rows;
  int has_bias, ready;
  ac_param weight, bias;
  const float *x;
  float *y, *dx;
} ac_linear;

int ac_linear_init(ac_linear *l, ac_backend *be, const char *prefix, size_t in, size_t out,
                   int bias, size_t max_rows, uint64_t seed);
void ac_linear_destroy(ac_linear *l);
int ac_linear_params(ac_linear *l, ac_param_list *list);
int ac_linear_forward(ac_linear *l, const float *x, size_t rows, const float **y);
int ac_linear_backward(ac_linear *l, const float *dy, const float **dx);

/* Embedding: y[r] = W[idx[r]], W (vocab, dim) "<p>.weight" ~ N(0, 0.02^2). idx is a device
 * int32 buffer (caller-owned, kept until backward); an index outside [0, vocab) gives a zero
 * row and no gradient. No input gradient. */
typedef struct {
  ac_backend *be;
  size_t vocab, dim, max_rows, rows;
  int ready;
  ac_param weight;
  const int32_t *idx;
  float *y;
} ac_embedding;

int ac_embedding_init(ac_embedding *l, ac_backend *be, const char *prefix, size_t vocab,
                      size_t dim, size_t max_rows, uint64_t seed);
void ac_embedding_destroy(ac_embedding *l);
int ac_embedding_params(ac_embedding *l, ac_param_list *list);
int ac_embedding_forward(ac_embedding *l, const int32_t *idx, size_t rows, const float **y);
int ac_embedding_backward(ac_embedding *l, const float *dy);

/* Learned positional embedding: y[b][t] = x[b][t] + P[t] for x (batch, t, dim), t <=
 * max_t; P (max_t, dim) "<p>.weight" ~ N(0, 0.02^2). backward returns dy itself as dx. */
typedef struct {
  ac_backend *be;
  size_t max_t, dim, max_batch, batch, t;
  int ready;
  ac_param weight;
  float *y;
} ac_posembed;

int ac_posembed_init(ac_posembed *l, ac_backend *be, const char *prefix, size_t max_t,
                     size_t dim, size_t max_batch, uint64_t seed);
void ac_posembed_destroy(ac_posembed *l);
int ac_posembed_params(ac_posembed *l, ac_param_list *list);
int ac_posembed_forward(ac_posembed *l, const float *x, size_t batch, size_t t,
                        const float **y);
int ac_posembed_backward(ac_posembed *l, const float *dy, const float **dx);

/* Layer normalisation over the last axis: y = (x - mean) / sqrt(var + eps) * g + b per row
 * of x (rows, dim), var biased; g "<p>.weight" = 1, b "<p>.bias" = 0. One fused primitive
 * each way (ac_layernorm_rows); caches x, the row means and 1/std. */
typedef struct {
  ac_backend *be;
  size_t dim, max_rows, rows;
  float eps;
  int ready;
  ac_param weight, bias;
  const float *x;
  float *y, *mean, *rstd, *dx;
} ac_layernorm;

int ac_layernorm_init(ac_layernorm *l, ac_backend *be, const char *prefix, size_t dim,
                      float eps, size_t max_rows);
void ac_layernorm_destroy(ac_layernorm *l);
int ac_layernorm_params(ac_layernorm *l, ac_param_list *list);
int ac_layernorm_forward(ac_layernorm *l, const float *x, size_t rows, const float **y);
int ac_layernorm_backward(ac_layernorm *l, const float *dy, const float **dx);

/* Elementwise activation y = f(x) of n values: AC_UNARY_RELU or AC_UNARY_GELU (any unary op
 * of ac_unary is accepted). No parameters. */
typedef struct {
  ac_backend *be;
  ac_unary_op op;
  size_t max_n, n;
  int ready;
  const float *x;
  float *y, *dx;
} ac_activation;

int ac_activation_init(ac_activation *l, ac_backend *be, ac_unary_op op, size_t max_n);
void ac_activation_destroy(ac_activation *l);
int ac_activation_forward(ac_activation *l, const float *x, size_t n, const float **y);
int ac_activation_backward(ac_activation *l, const float *dy, const float **dx);

/* Residual add y = a + b of n values. Backward: both inputs receive dy (returned as is). */
typedef struct {
  ac_backend *be;
  size_t max_n, n;
  int ready;
  float *y;
} ac_residual;

int ac_residual_init(ac_residual *l, ac_backend *be, size_t max_n);
void ac_residual_destroy(ac_residual *l);
int ac_residual_forward(ac_residual *l, const float *a, const float *b, size_t n,
                        const float **y);
int ac_residual_backward(ac_residual *l, const float *dy, const float **da, const float **db);

/* Inverted dropout with probability p (0 <= p < 1): in AC_MODE_TRAIN y = x * mask with the
 * mask of ac_dropout_mask(seed, offset); offset starts at 0 and advances by n each training
 * forward, so a run is reproducible and identical on every backend. In AC_MODE_EVAL (or p
 * == 0) y is x itself and backward returns dy itself. */
typedef struct {
  ac_backend *be;
  float p;
  uint64_t seed, offset;
  size_t max_n, n;
  int ready, active;
  float *mask, *y, *dx;
} ac_dropout;

int ac_dropout_init(ac_dropout *l, ac_backend *be, float p, uint64_t seed, size_t max_n);
void ac_dropout_destroy(ac_dropout *l);
int ac_dropout_forward(ac_dropout *l, const float *x, size_t n, ac_mode mode, const float **y);
int ac_dropout_backward(ac_dropout *l, const float *dy, const float **dx);

/* Causal multi-head self-attention with its projections, on x (batch, t, dim), t <= max_t:
 * qkv = x Wqkv^T + bqkv ("<p>.qkv.weight" (3 dim, dim), "<p>.qkv.bias"), each token's qkv
 * row laid out (3, heads, dim / heads); per head softmax(q k^T / sqrt(dh) + causal mask) v;
 * heads concatenated and projected ("<p>.proj.weight" (dim, dim), "<p>.proj.bias").
 * dim must be a multiple of heads. */
typedef struct {
  ac_backend *be;
  size_t dim, heads, max_batch, max_t, batch, t;
  int ready;
  ac_linear qkv, proj;
  float *probs, *ctx, *dprobs, *dqkv;
} ac_attention;

int ac_attention_init(ac_attention *l, ac_backend *be, const char *prefix, size_t dim,
                      size_t heads, size_t max_t, size_t max_batch, uint64_t seed);
void ac_attention_destroy(ac_attention *l);
int ac_attention_params(ac_attention *l, ac_param_list *list);
int ac_attention_forward(ac_attention *l, const float *x, size_t batch, size_t t,
                         const float **y);
int ac_attention_backward(ac_attention *l, const float *dy, const float **dx);

/* Softmax cross-entropy over a vocabulary: logits (rows, classes), labels device int32 (a
 * label outside [0, classes) marks an ignored row). forward writes the mean loss over the
 * counted rows to *loss (host; 0 when no row counts); backward returns dlogits for that
 * mean. Caches the probabilities and the labels pointer (caller keeps labels). */
typedef struct {
  ac_backend *be;
  size_t classes, max_rows, rows, counted;
  int ready;
  const int32_t *labels;
  float *probs, *loss, *ones, *counts, *dlogits;
} ac_celoss;

int ac_celoss_init(ac_celoss *l, ac_backend *be, size_t classes, size_t max_rows);
void ac_celoss_destroy(ac_celoss *l);
int ac_celoss_forward(ac_celoss *l, const float *logits, const int32_t *labels, size_t rows,
                    double *loss);
int ac_celoss_backward(ac_celoss *l, const float **dlogits);

/* 2-D convolution, NCHW, by im2col + gemm: x (n, in_c, h, w) -> y (n, out_c, oh, ow) with
 * W (out_c, in_c, k, k) "<p>.weight" ~ N(0, 2 / (in_c k k)) (He) and optionally b (out_c)
 * "<p>.bias" = 0. `chunk` images at a time (0: max_batch) are lowered into one column
 * matrix and multiplied by ONE gemm (N = chunk oh ow), whose products are permuted to NCHW;
 * both live in a workspace of ac_conv2d_workspace_floats() = chunk oh ow (in_c k k + out_c)
 * floats: pass a caller-owned device buffer to share it between layers (used only inside
 * forward and backward calls), or NULL to let the layer allocate its own. Backward
 * recomputes im2col rather than keeping it. */
typedef struct {
  ac_backend *be;
  ac_conv2d_geom g;       /* g.n is max_batch */
  size_t out_c, oh, ow, chunk, batch;
  int has_bias, ready, owns_ws;
  ac_param weight, bias;
  const float *x;
  float *ws, *y, *dx;
} ac_conv2d;

size_t ac_conv2d_workspace_floats(size_t in_c, size_t out_c, size_t k, size_t oh, size_t ow,
                                  size_t chunk);
int ac_conv2d_init(ac_conv2d *l, ac_backend *be, const char *prefix, size_t in_c,
                   size_t out_c, size_t h, size_t w, size_t k, size_t stride, size_t pad,
                   int bias, size_t max_batch, size_t chunk, float *workspace, uint64_t seed);
void ac_conv2d_destroy(ac_conv2d *l);
int ac_conv2d_params(ac_conv2d *l, ac_param_list *list);
int ac_conv2d_forward(ac_conv2d *l, const float *x, size_t batch, const float **y);
int ac_conv2d_backward(ac_conv2d *l, const float *dy, const float **dx);

/* Batch normalisation of x (n, c, hw) per channel (hw = H*W for images, 1 for features):
 * AC_MODE_TRAIN normalises with the batch mean and biased variance and updates
 * running = (1 - momentum) running + momentum batch (variance unbiased, n hw / (n hw - 1));
 * AC_MODE_EVAL uses the running statistics (mean 0, var 1 at init). g "<p>.weight" = 1,
 * b "<p>.bias" = 0. Backward follows the mode of the last forward. Like every layer it
 * keeps the pointer x (not a copy) until backward. Two passes over the tensor forward, two
 * backward (ac_channel_*).
 * Fusions for a ResNet block: after ac_batchnorm_fuse_relu the output is
 * relu(bn(x) [+ res]) and backward takes the gradient of that output;
 * ac_batchnorm_forward_res adds a residual res (caller-owned, only read during the call)
 * before the ReLU, and ac_batchnorm_backward_res also returns the gradient reaching res
 * (dy itself without a fused ReLU, dy masked by it with one, in a layer-owned buffer). */
typedef struct {
  ac_backend *be;
  size_t c, hw, max_batch, batch;
  float eps, momentum;
  int ready, relu;
  ac_mode mode;
  ac_param weight, bias;
  ac_tensor running_mean, running_var;
  const float *x;
  float *y, *dx, *dres, *mean, *rstd, *s1, *s2, *coef;
} ac_batchnorm;

int ac_batchnorm_init(ac_batchnorm *l, ac_backend *be, const char *prefix, size_t c,
                      size_t hw, float eps, float momentum, size_t max_batch);
void ac_batchnorm_destroy(ac_batchnorm *l);
/* Fuses a ReLU into the output (allocates the buffer backward_res hands out). */
int ac_batchnorm_fuse_relu(ac_batchnorm *l);
/* The normalised input of the last forward, xhat = (x - mean) rstd (batch statistics in
 * training mode, running ones in eval mode), into the caller's buffer of batch c hw floats
 * (the layer no longer keeps it: backward recomputes what it needs from x). */
int ac_batchnorm_xhat(ac_batchnorm *l, float *xhat);
int ac_batchnorm_params(ac_batchnorm *l, ac_param_list *list);
int ac_batchnorm_forward(ac_batchnorm *l, const float *x, size_t batch, ac_mode mode,
                         const float **y);
int ac_batchnorm_forward_res(ac_batchnorm *l, const float *x, const float *res, size_t batch,
                             ac_mode mode, const float **y);
int ac_batchnorm_backward(ac_batchnorm *l, const float *dy, const float **dx);
/* dres may be NULL (then this is ac_batchnorm_backward); dx may be NULL too. */
int ac_batchnorm_backward_res(ac_batchnorm *l, const float *dy, const float **dx,
                              const float **dres);

/* Max or average pooling (ac_pool2d_forward) of x (n, c, h, w), window k, stride, pad. */
typedef struct {
  ac_backend *be;
  ac_pool_op op;
  ac_conv2d_geom g;       /* g.n is max_batch */
  size_t oh, ow, batch;
  int ready;
  int32_t *argmax;
  float *y, *dx;
} ac_pool;

int ac_pool_init(ac_pool *l, ac_backend *be, ac_pool_op op, size_t c, size_t h, size_t w,
                   size_t k, size_t stride, size_t pad, size_t max_batch);
void ac_pool_destroy(ac_pool *l);
int ac_pool_forward(ac_pool *l, const float *x, size_t batch, const float **y);
int ac_pool_backward(ac_pool *l, const float *dy, const float **dx);

/* Global average pooling: x (n, c, hw) -> y (n, c). */
typedef struct {
  ac_backend *be;
  size_t c, hw, max_batch, batch;
  int ready;
  float *y, *dx;
} ac_gap;

int ac_gap_init(ac_gap *l, ac_backend *be, size_t c, size_t hw, size_t max_batch);
void ac_gap_destroy(ac_gap *l);
int ac_gap_forward(ac_gap *l, const float *x, size_t batch, const float **y);
int ac_gap_backward(ac_gap *l, const float *dy, const float **dx);

/* ------------------------------------------------------------------------------------ */
/* Model blocks (accel/model.c), built from the layers above with the same conventions.   */

/* Pre-layer-norm Transformer block on x (batch, t, dim):
 *   h = x + drop(attn(ln1(x))),  y = h + drop(fc2(gelu(fc1(ln2(h))))),
 * fc1 (dim -> mlp), fc2 (mlp -> dim). Names: "<p>.ln1", "<p>.attn.qkv", "<p>.attn.proj",
 * "<p>.ln2", "<p>.mlp.fc1", "<p>.mlp.fc2" (each with .weight / .bias). */
typedef struct {
  ac_backend *be;
  size_t dim, max_batch, max_t, batch, t;
  int ready;
  ac_layernorm ln1, ln2;
  ac_attention attn;
  ac_linear fc1, fc2;
  ac_activation gelu;
  ac_dropout drop1, drop2;
  ac_residual add1, add2;
  float *dh, *dx;
} ac_tblock;

int ac_tblock_init(ac_tblock *b, ac_backend *be, const char *prefix, size_t dim, size_t heads,
                   size_t mlp, size_t max_t, size_t max_batch, float dropout, uint64_t seed);
void ac_tblock_destroy(ac_tblock *b);
int ac_tblock_params(ac_tblock *b, ac_param_list *list);
int ac_tblock_forward(ac_tblock *b, const float *x, size_t batch, size_t t, ac_mode mode,
                      const float **y);
int ac_tblock_backward(ac_tblock *b, const float *dy, const float **dx);

/* Decoder-only Transformer language model: token embedding "tok" + learned positional
 * embedding "pos", `layers` blocks "layer<i>", final layer norm "lnf", linear head "head"
 * (dim -> vocab, with bias), softmax cross-entropy against targets. */
typedef struct {
  size_t vocab, ctx, dim, heads, layers, mlp, batch;
  float dropout;
  uint64_t seed;
} ac_lm_config;

/* The benchmark client's model: vocab 256, ctx 64, dim 128, 4 heads, 2 layers, mlp 512,
 * batch 32, dropout 0, seed 1. */
void ac_lm_config_default(ac_lm_config *c);

typedef struct {
  ac_backend *be;
  ac_lm_config cfg;
  size_t batch, t;
  int ready;
  ac_embedding tok;
  ac_posembed pos;
  ac_tblock *blocks;
  ac_layernorm lnf;
  ac_linear head;
  ac_celoss xent;
  const float *logits;   /* (batch * t, vocab) of the last forward, owned by head */
} ac_lm;

int ac_lm_init(ac_lm *m, ac_backend *be, const ac_lm_config *cfg);
void ac_lm_destroy(ac_lm *m);
int ac_lm_params(ac_lm *m, ac_param_list *list);
/* tokens and targets: device int32 (batch, t), caller-owned and kept until backward;
 * *loss (host) is the mean cross-entropy over targets inside [0, vocab). */
int ac_lm_forward(ac_lm *m, const int32_t *tokens, const int32_t *targets, size_t batch,
                  size_t t, ac_mode mode, double *loss);
/* Adds d(mean loss)/d(param) to every grad. */
int ac_lm_backward(ac_lm *m);

/* ResNet basic block on x (n, in_c, h, w):
 *   y = relu(bn2(conv2(relu(bn1(conv1(x))))) + s(x)),
 * conv1 3x3 with stride, conv2 3x3, s the identity or, when the stride is not 1 or the
 * width changes, a 1x1 conv with that stride and a batch norm ("<p>.short.conv",
 * "<p>.short.bn"). Convs have no bias. Convs share the caller's workspace (see ac_conv2d;
 * ac_basicblock_workspace_floats gives its size, NULL lets each conv own one). relu1 is
 * fused into bn1, the residual add and relu2 into bn2 (ac_batchnorm_fuse_relu,
 * ac_batchnorm_forward_res). */
typedef struct {
  ac_backend *be;
  size_t in_c, out_c, oh, ow, batch;
  int has_short, ready;
  ac_conv2d conv1, conv2, sconv;
  ac_batchnorm bn1, bn2, sbn;
  float *dx;
} ac_basicblock;

size_t ac_basicblock_workspace_floats(size_t in_c, size_t out_c, size_t h, size_t w,
                                      size_t stride, size_t chunk);
int ac_basicblock_init(ac_basicblock *b, ac_backend *be, const char *prefix, size_t in_c,
                       size_t out_c, size_t h, size_t w, size_t stride, size_t max_batch,
                       size_t chunk, float *workspace, uint64_t seed);
void ac_basicblock_destroy(ac_basicblock *b);
int ac_basicblock_params(ac_basicblock *b, ac_param_list *list);
int ac_basicblock_forward(ac_basicblock *b, const float *x, size_t batch, ac_mode mode,
                          const float **y);
int ac_basicblock_backward(ac_basicblock *b, const float *dy, const float **dx);

/* ResNet for small images: stem conv 3x3 (in_c -> width[0]) "stem.conv" + bn "stem.bn" +
 * relu; `stages` stages of `blocks` basic blocks "stage<s>.block<i>" (the first block of
 * stages after the first has stride 2); global average pooling; linear "fc" to classes;
 * softmax cross-entropy. */
#define AC_RESNET_MAX_STAGES 4
typedef struct {
  size_t in_c, h, w, classes, stages, blocks, batch, chunk;
  size_t width[AC_RESNET_MAX_STAGES];
  float bn_eps, bn_momentum;
  uint64_t seed;
} ac_resnet_config;

/* The benchmark client's ResNet-20 for 28x28x1: 3 stages of 3 blocks, widths 16/32/64,
 * 10 classes, batch 128, im2col chunk 8 images, bn eps 1e-5, momentum 0.1, seed 1. */
void ac_resnet_config_default(ac_resnet_config *c);

typedef struct {
  ac_backend *be;
  ac_resnet_config cfg;
  size_t batch, nblocks;
  int ready;
  float *ws;
  ac_conv2d stem;
  ac_batchnorm stem_bn;
  ac_basicblock *blocks;
  ac_gap gap;
  ac_linear fc;
  ac_celoss xent;
  const float *logits;   /* (batch, classes) of the last forward, owned by fc */
} ac_resnet;

int ac_resnet_init(ac_resnet *m, ac_backend *be, const ac_resnet_config *cfg);
void ac_resnet_destroy(ac_resnet *m);
int ac_resnet_params(ac_resnet *m, ac_param_list *list);
/* images: device (batch, in_c, h, w); labels: device int32 (batch); both caller-owned and
 * kept until backward. *loss (host): mean cross-entropy. */
int ac_resnet_forward(ac_resnet *m, const float *images, const int32_t *labels, size_t batch,
                      ac_mode mode, double *loss);
int ac_resnet_backward(ac_resnet *m);

/* ---- end of layers ---- */

/* ==================================================================================== */
/* Optimizers and Shampoo's worker half (accel/optim*.c). Owned by the optimizers team.    */
/*                                                                                          */
/* Every optimizer is written once against the primitives above (no backend-specific code). */
/* An optimizer holds pointers to the caller's parameters (not owned: they must outlive it, */
/* and all must live on one backend) and its own device state; step(lr) reads each grad and */
/* updates each value in place. The learning rate is an argument of every step so that a   */
/* schedule (below) stays a pure function the caller evaluates. Steps count from 1.         */
/* Shampoo reuses the numerics core's block layout and grafting definitions, so the worker  */
/* and precondd cannot disagree on either: hence this include.                              */

#include "preconditioner.h"

/* ---- Learning-rate schedules: pure functions of the step (no backend, cannot fail) ---- */

/* Linear warmup: base_lr * min(1, step / warmup_steps). warmup_steps <= 0 means none
 * (base_lr); step < 0 counts as 0. */
double ac_lr_linear_warmup(double base_lr, long step, long warmup_steps);

/* Cosine decay from base_lr to min_lr over decay_steps:
 * min_lr + (base_lr - min_lr) (1 + cos(pi s / decay_steps)) / 2 with s = clamp(step, 0,
 * decay_steps); min_lr from then on. decay_steps <= 0 means no decay (base_lr). */
double ac_lr_cosine_decay(double base_lr, double min_lr, long step, long decay_steps);

/* Step decay: base_lr * gamma^floor(step / step_size). step_size <= 0 means no decay;
 * step < 0 counts as 0. */
double ac_lr_step_decay(double base_lr, double gamma, long step, long step_size);

typedef enum {
  AC_LR_CONSTANT = 0,  /* base_lr after the warmup */
  AC_LR_COSINE,        /* ac_lr_cosine_decay over decay_steps after the warmup */
  AC_LR_STEP           /* ac_lr_step_decay: times gamma every step_size steps after it */
} ac_lr_decay;

/* A warmup followed by a decay. At step t >= 1: t <= warmup_steps gives
 * ac_lr_linear_warmup(base_lr, t, warmup_steps); after it the decay runs on
 * s = t - warmup_steps (so the decay starts from base_lr exactly where the warmup ends). */
typedef struct {
  double base_lr;      /* > 0 */
  long warmup_steps;   /* >= 0 */
  ac_lr_decay decay;
  long decay_steps;    /* COSINE: > 0 */
  double min_lr;       /* COSINE: in [0, base_lr] */
  long step_size;      /* STEP: > 0 */
  double gamma;        /* STEP: in (0, 1] */
} ac_lr_schedule;

/* A constant base_lr with no warmup (decay_steps 1, step_size 1, gamma 1: valid if the
 * caller switches decay). NULL is a no-op. */
void ac_lr_schedule_default(ac_lr_schedule *sched, double base_lr);

/* AC_OK, or AC_EINVAL for a NULL schedule or a field out of the ranges above. */
int ac_lr_schedule_check(const ac_lr_schedule *sched);

/* The learning rate at step (>= 1) of a schedule that passed ac_lr_schedule_check. */
double ac_lr_schedule_at(const ac_lr_schedule *sched, long step);

/* ---- Gradient clipping by global norm ---- */

/* norm = sqrt(sum over params of |grad|^2), accumulated in double. If norm > max_norm,
 * every grad is scaled by max_norm / norm; otherwise grads are untouched. max_norm may be
 * INFINITY (measure only). If norm is not finite (NaN or Inf in a grad) the grads are left
 * as they are: the caller sees it in *norm and should skip the step. *norm (may be NULL) gets
 * the norm before clipping. params: nparams pointers to parameters on one backend.
 * Returns AC_OK; AC_EINVAL (NULL params or entry, max_norm <= 0 or NaN); AC_EMISMATCH
 * (parameters on different backends); a device error. */
int ac_clip_grad_norm(ac_param *const *params, size_t nparams, double max_norm, double *norm);

/* ---- SGD with momentum ---- */

typedef struct {
  float momentum;      /* mu in [0, 1); 0: plain SGD, no buffer. Default 0.9 */
  int nesterov;        /* 1: Nesterov lookahead (needs momentum > 0). Default 0 */
  float weight_decay;  /* >= 0; L2 coupled into the gradient as in classic SGD. Default 0 */
} ac_sgd_opts;

void ac_sgd_opts_default(ac_sgd_opts *opts);

/* Per step, per parameter (buf starts at 0):
 *   d = g + wd p;  buf = mu buf + d;  d = nesterov ? d + mu buf : buf;  p -= lr d.
 * (With mu = 0: p -= lr (g + wd p).) */
typedef struct ac_sgd ac_sgd;

/* Creates an SGD optimizer over params (nparams >= 1 pointers, not owned, all on one
 * backend). opts NULL: defaults. On AC_OK *out is owned by the caller (ac_sgd_destroy);
 * on error *out is NULL. Errors: AC_EINVAL (bad options, NULL entries, a parameter listed
 * twice), AC_EMISMATCH (different backends), AC_ENOMEM. */
int ac_sgd_create(ac_sgd **out, ac_param *const *params, size_t nparams,
                  const ac_sgd_opts *opts);

/* One step with learning rate lr (finite, >= 0). Grads are read, not changed. */
int ac_sgd_step(ac_sgd *opt, float lr);

/* Steps taken so far. */
long ac_sgd_steps(const ac_sgd *opt);

/* Frees the optimizer's state (not the parameters). NULL is a no-op. */
void ac_sgd_destroy(ac_sgd *opt);

/* ---- AdamW ---- */

typedef struct {
  float beta1, beta2;  /* [0, 1); defaults 0.9, 0.999 */
  float eps;           /* > 0; default 1e-8 */
  float weight_decay;  /* >= 0, decoupled: p -= lr wd p; default 0.01 */
} ac_adamw_opts;

void ac_adamw_opts_default(ac_adamw_opts *opts);

/* AdamW (Loshchilov and Hutter) with bias correction: ac_adamw_update per parameter. */
typedef struct ac_adamw ac_adamw;

/* As ac_sgd_create. */
int ac_adamw_create(ac_adamw **out, ac_param *const *params, size_t nparams,
                    const ac_adamw_opts *opts);
int ac_adamw_step(ac_adamw *opt, float lr);
long ac_adamw_steps(const ac_adamw *opt);
void ac_adamw_destroy(ac_adamw *opt);

/* ---- Shampoo, the worker half ---- */
/*
 * The worker computes statistics on the device and applies roots computed elsewhere
 * (precondd, or the caller itself). One training step:
 *   1. backward pass (grads filled);
 *   2. ac_shampoo_compute_stats: if statistics are due for the coming step, G G^T and G^T G
 *      of every block (ac_syrk_packed), downloaded once into host buffers the caller reads
 *      with ac_shampoo_block_stats and hands to libprecond's push;
 *   3. ac_shampoo_set_roots for every block whose newer roots the caller holds;
 *   4. ac_shampoo_step(lr).
 * Blocks: for each parameter, in the order given at create, the blocks of pc_layout_init
 * over its shape (a scalar counts as shape {1}); block ids run over all parameters in that
 * order, which is the order precondd numbers the blocks of the same tensors registered in
 * the same order. A parameter the layout marks diagonal has no blocks.
 *
 * The update of a parameter at step t:
 *   M = G, or with beta1 > 0 the first moment f = b1 f + (1 - b1) G, M = f / (1 - b1^t)
 *       (beta1_nesterov: M = b1 f / (1 - b1^(t+1)) + (1 - b1) G / (1 - b1^t));
 *   D = grafted direction of M (pc_graft_direction_f32's formulas, on the device; their
 *       second moments from G; normalisation over the whole tensor; with beta1 > 0 the
 *       Adam graft keeps no first moment of its own: M is it);
 *   for each block b: if t >= start_step, b holds a root, and its staleness
 *       t - source_step is within max_staleness (when that is set),
 *       P_b = L_b^(-1/4) M_b R_b^(-1/4) (a missing side is the identity; one_sided: only
 *       the root of the smaller side of order > 1), rescaled to
 *       |D_b| (Frobenius; P_b replaced by D_b when |P_b| is 0 or not finite), else
 *       P_b = D_b (the grafted fallback, counted);
 *   buf = mu buf + P;  U = nesterov ? P + mu buf : buf;  p -= lr (U + wd p).
 * Diagonal parameters take U from D (the grafted step is their whole step, not a
 * fallback, and is not counted).
 */

typedef struct {
  pc_layout_opts layout;  /* block_size, skip_limit: must match the daemon's. Defaults */
  pc_graft_opts graft;    /* grafting (the step length). Default Adam, its defaults */
  float momentum;         /* mu in [0, 1) on the grafted direction. Default 0 */
  int nesterov;           /* needs momentum > 0. Default 0 */
  float weight_decay;     /* >= 0, decoupled. Default 0 */
  long stats_interval;    /* statistics at steps 1, 1 + k, 1 + 2k, ...; >= 1. Default 1 */
  long start_step;        /* first step that may use roots; >= 1. Default 1 */
  long max_staleness;     /* a root older than this many steps (t - source_step) is not
                             used: the block takes the grafted fallback. 0: no bound.
                             >= 0. Default 0 */
  /* The daemon's: the statistics EMA (1 = sum) and the relative ridge of the roots. Kept
   * here so that one struct configures a run (the caller registers them with precondd);
   * the worker itself hands out raw G G^T increments and does not use them. */
  float beta2;            /* [0, 1]. Default 0.95 */
  double epsilon;         /* > 0. Default 1e-6 */
  float beta1;            /* first moment of the gradient in [0, 1); 0: off (M = G). Not
                             with the normed grafts. Default 0.9 */
  int beta1_nesterov;     /* Nesterov look-ahead of the first moment; needs beta1 > 0.
                             Default 0 */
  int one_sided;          /* 1: apply one root per block (the caller registers root
                             exponent 2, so P_b = L_b^(-1/2) M_b or M_b R_b^(-1/2)).
                             Default 0 */
} ac_shampoo_opts;

void ac_shampoo_opts_default(ac_shampoo_opts *opts);

typedef struct ac_shampoo ac_shampoo;

/* As ac_sgd_create; params also must have a valid layout under opts->layout
 * (AC_EINVAL otherwise). The caller owns *out (ac_shampoo_destroy). */
int ac_shampoo_create(ac_shampoo **out, ac_param *const *params, size_t nparams,
                      const ac_shampoo_opts *opts);

void ac_shampoo_destroy(ac_shampoo *s);

/* Blocks over all parameters. */
size_t ac_shampoo_nblocks(const ac_shampoo *s);

/* The layout of parameter i (owned by s; valid until destroy), or NULL if i is out of
 * range. */
const pc_layout *ac_shampoo_layout(const ac_shampoo *s, size_t param);

typedef struct {
  size_t param;             /* index into the params given at create */
  size_t index;             /* block within that parameter's layout */
  pc_block block;           /* rows, cols and offsets in the parameter's 2-D view */
  uint64_t version;         /* version of the roots held; 0: none yet */
  uint64_t source_step;     /* their source step (as handed in) */
  uint64_t fallback_steps;  /* steps this block took the grafted fallback */
  long staleness;           /* t - source_step at the last step that used the roots; -1:
                               never used */
} ac_shampoo_block;

/* Fills *info for block id b. AC_EINVAL for b out of range or NULL. */
int ac_shampoo_block_info(const ac_shampoo *s, size_t b, ac_shampoo_block *info);

/* Block-steps that took the grafted fallback, summed over blocks. */
uint64_t ac_shampoo_fallback_total(const ac_shampoo *s);

/* What the last step did, for the clients' reports. */
typedef struct {
  long step;                /* its number; 0: no step yet (the rest is then zero) */
  size_t preconditioned;    /* blocks that used roots */
  size_t fallback;          /* blocks that took the grafted fallback */
  double staleness_mean;    /* over the blocks that used roots; NaN if none did */
  long staleness_max;       /* -1 if none did */
} ac_shampoo_step_info;

/* Fills *info about the last ac_shampoo_step. AC_EINVAL for NULL. */
int ac_shampoo_last_step(const ac_shampoo *s, ac_shampoo_step_info *info);

/* Steps taken so far. */
long ac_shampoo_steps(const ac_shampoo *s);

/* If statistics are due for the coming step t = steps + 1 ((t - 1) % stats_interval == 0),
 * computes G G^T and G^T G of every block from the current grads on the device and copies
 * them (packed upper, pc_pack_f32's layout) into host buffers owned by s: *due = 1 and
 * *step = t. Otherwise nothing is computed and *due = 0. due and step may be NULL.
 * Waits for the device (one download for all blocks). */
int ac_shampoo_compute_stats(ac_shampoo *s, int *due, long *step);

/* The host statistics of block b from the last ac_shampoo_compute_stats that computed:
 * *left = packed G G^T (ac_packed_len(rows) values), *right = packed G^T G
 * (ac_packed_len(cols)); owned by s, valid until the next compute or destroy. Either
 * pointer argument may be NULL. AC_EINVAL if b is out of range or nothing was computed yet. */
int ac_shampoo_block_stats(const ac_shampoo *s, size_t b, const float **left,
                           const float **right);

typedef enum {
  AC_ROOT_DENSE = 0,   /* n x n row-major */
  AC_ROOT_PACKED = 1   /* packed upper, ac_packed_len(n) values */
} ac_root_format;

/* One version of a block's roots, as a caller hands it in (the fields of libprecond's
 * precond_roots map one to one). left ~ L^(-1/4) of order n_left (= the block's rows),
 * right ~ R^(-1/4) of order n_right (= its cols); a side may be NULL with its n 0
 * (one-sided: the identity there), not both. HOST pointers. */
typedef struct {
  uint64_t version;       /* > 0, increasing per block */
  uint64_t source_step;   /* step of the newest statistics the roots come from */
  ac_root_format format;
  size_t n_left;
  const float *left;
  size_t n_right;
  const float *right;
} ac_shampoo_roots;

/* Hands block b one version of its roots, copied to the device (kept dense) before return.
 * A version not newer than the one held is ignored (AC_OK, nothing changes); a newer one
 * replaces both sides (a side it lacks becomes the identity).
 * Returns AC_OK; AC_EINVAL (NULL, b out of range, version 0, both sides NULL, a bad format,
 * a non-finite value: nothing changes); AC_EMISMATCH (n_left or n_right not the block's);
 * AC_ENOMEM or a device error (then the block holds no roots until the next version). */
int ac_shampoo_set_roots(ac_shampoo *s, size_t b, const ac_shampoo_roots *roots);

/* One step with learning rate lr (finite, >= 0), as described above. Grads are read, not
 * changed. Waits for the device once or twice per parameter (grafting norms). */
int ac_shampoo_step(ac_shampoo *s, float lr);

/* ---- K-FAC, the worker's kernels (accel/kfac.c; docs/kfac.md) ---- */
/*
 * Factors of one layer for precondd's running averages (packed upper, device memory), the
 * batch-norm diagonal Fisher, and the preconditioned update from inverses the caller holds.
 * Inputs are explicit device pointers (a layer's cached input, output gradient, im2col
 * patches), so a layer hook only passes pointers; scratch is a caller-owned device buffer of
 * the *_workspace_floats size (NULL where that size is 0). loss_scale is the count the loss
 * is a mean over (the batch size; tokens for a language model): output gradients are scaled
 * by it to per-example gradients. The bias, when present, is the LAST row/column of A and
 * of the layer's gradient matrix (a 1 appended to each input).
 */

/* Dense layer, rows inputs a (rows x in, row stride lda): A = (1/rows) sum_r [a_r; 1][a_r; 1]^T
 * (order in + has_bias). Overwrites a_packed. ws: ac_kfac_dense_workspace_floats. */
size_t ac_kfac_dense_workspace_floats(size_t rows, size_t in, int has_bias);
int ac_kfac_dense_factor_a(ac_backend *be, size_t rows, size_t in, const float *a, size_t lda,
                           int has_bias, float *a_packed, float *ws);

/* Dense layer, output gradients g (rows x out, row stride ldg) of the mean loss:
 * G = (1/rows) sum_r (s g_r)(s g_r)^T, s = loss_scale (> 0). Overwrites g_packed. */
int ac_kfac_dense_factor_g(ac_backend *be, size_t rows, size_t out, const float *g, size_t ldg,
                           float loss_scale, float *g_packed);

/* Convolution (KFC, Grosse & Martens 2016), over nimg images of a batch of `batch`, so that a
 * batch im2col'd in chunks accumulates (accumulate 0 for the first chunk, 1 after):
 *   A += (1/(batch npos)) sum_{b,t} [a_bt; 1][a_bt; 1]^T   (the mean over all patches)
 *   G += (1/batch) sum_{b,t} (s dy_bt)(s dy_bt)^T           (per image, summed over positions)
 * col is ac_im2col's (nimg, ckk, npos) with ckk = in_c k k; dy the output gradient (nimg,
 * out_c, npos) NCHW. A (x) G is KFC's Omega (x) Gamma; the split is docs/kfac.md's. */
size_t ac_kfac_conv_workspace_floats(size_t nimg, size_t ckk, size_t npos, int has_bias);
int ac_kfac_conv_factor_a(ac_backend *be, size_t nimg, size_t ckk, size_t npos,
                          const float *col, int has_bias, size_t batch, int accumulate,
                          float *a_packed, float *ws);
int ac_kfac_conv_factor_g(ac_backend *be, size_t nimg, size_t out_c, size_t npos,
                          const float *dy, float loss_scale, size_t batch, int accumulate,
                          float *g_packed);

/* Batch norm (Osawa et al. 2019): the diagonal Fisher of (gamma, beta) per channel from the
 * per-example gradients dgamma_n = s sum_hw dy xhat, dbeta_n = s sum_hw dy:
 * f_gamma[c] = (1/n) sum_n dgamma_n[c]^2, f_beta likewise. dy and xhat are (n, c, hw) (the
 * layer's output gradient and its cached xhat). Overwrites f_gamma, f_beta (c values each).
 * Fold into a running average with ac_axpby; precondition with ac_kfac_bn_precondition. */
size_t ac_kfac_bn_workspace_floats(size_t n, size_t c, size_t hw);
int ac_kfac_bn_fisher(ac_backend *be, size_t n, size_t c, size_t hw, const float *dy,
                      const float *xhat, float loss_scale, float *f_gamma, float *f_beta,
                      float *ws);
/* p[i] = grad[i] / (fisher[i] + damping) for i < count (damping > 0, finite); p may be grad.
 * ws: count floats. */
int ac_kfac_bn_precondition(ac_backend *be, size_t count, const float *grad,
                            const float *fisher, float damping, float *p, float *ws);

/* The K-FAC update of one layer from the damped inverses (dense on the device):
 * [pw | pb] = g_inv [gw | gb] a_inv, gw and pw out x in, gb and pb out values (both NULL for a
 * layer without bias), g_inv out x out, a_inv order in + (gb != NULL). Two products; pw may
 * be gw and pb gb. ws: ac_kfac_precondition_workspace_floats. */
size_t ac_kfac_precondition_workspace_floats(size_t out, size_t in, int has_bias);
int ac_kfac_precondition(ac_backend *be, size_t out, size_t in, const float *gw,
                         const float *gb, const float *g_inv, const float *a_inv, float *pw,
                         float *pb, float *ws);

/* The same update from the eigen forms (pc_kfac_eigen_*; KAISA's default):
 *   [pw | pb] = Q_G [(Q_G^T [gw | gb] Q_A) / (v_G v_A^T + lambda)] Q_A^T,
 * qg out x out, vg out values, qa and va of order in + (gb != NULL), lambda >= 0 and finite.
 * Four products and an elementwise division; pw may be gw and pb gb. ws:
 * ac_kfac_eigen_precondition_workspace_floats. */
size_t ac_kfac_eigen_precondition_workspace_floats(size_t out, size_t in, int has_bias);
int ac_kfac_eigen_precondition(ac_backend *be, size_t out, size_t in, const float *gw,
                               const float *gb, const float *qg, const float *vg,
                               const float *qa, const float *va, float lambda, float *pw,
                               float *pb, float *ws);

/* One preconditioned tensor and its gradient, for the KL clip (count values each). */
typedef struct {
  size_t count;
  float *p;
  const float *grad;
} ac_kfac_pg;

/* KL clip over all layers: nu = pc_kfac_kl_scale(kl_clip, lr, sum_l <p_l, grad_l>), then every
 * p_l *= nu (when nu < 1). *nu (host, may be NULL) gets it. dev1: one device float of scratch.
 * Returns AC_OK; AC_EINVAL (bad arguments, or a non-finite sum: nothing scaled, *nu = 0). */
int ac_kfac_kl_clip(ac_backend *be, const ac_kfac_pg *layers, size_t nlayers, double lr,
                    double kl_clip, float *dev1, double *nu);

/* ---- end of optimizers ---- */

#ifdef __cplusplus
}
#endif

#endif /* PRECOND_ACCEL_H */
