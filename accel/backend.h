/*
 * backend.h -- the worker runtime's backend interface: status codes, backends, device memory,
 * the primitives, tensors and parameters (accel.h includes it with the layers and optimizers).
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
#ifndef PRECOND_ACCEL_BACKEND_H
#define PRECOND_ACCEL_BACKEND_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* ------------------------------------------------------------------------------------ */
/* Status codes                                                                           */

enum {
  AC_OK = 0,
  AC_EINVAL = -1,   /* bad argument (null pointer, size, stride, option out of range) */
  AC_ENOMEM = -2,   /* host or device allocation failed */
  AC_ENODEV = -3,   /* the backend is compiled in but no usable device exists */
  AC_ENOTSUP = -4,  /* the backend (or feature) is not compiled into this build */
  AC_EDEVICE = -5,  /* the device runtime, driver or a library (cuBLAS) reported an error */
  AC_EMISMATCH = -6 /* objects from different backends, or shapes that do not match */
};

/* Returns a static, human-readable message for a status code. Never returns NULL. */
const char *ac_strerror(int status);

/* ------------------------------------------------------------------------------------ */
/* Backends                                                                               */

typedef enum {
  AC_BACKEND_CPU = 0, /* host memory, OpenBLAS; always available */
  AC_BACKEND_CUDA = 1 /* one CUDA device, cuBLAS + own kernels; needs -Dcuda and a GPU */
} ac_backend_kind;

/* The widest vector instructions the CPU backend's direct kernels may use (ac_conv3x3 and
 * its weight gradient): the processor's best by default; a lower cap selects a narrower
 * variant, so that tests run every variant on one machine and benchmarks compare them side
 * by side. A cap above what the processor runs means its best. */
typedef enum {
  AC_CPU_ISA_BEST = 0,     /* the widest the processor runs (default) */
  AC_CPU_ISA_PORTABLE = 1, /* no direct kernels: the layers use im2col + gemm */
  AC_CPU_ISA_AVX2 = 2,     /* at most AVX2 + FMA (8-float vectors) */
  AC_CPU_ISA_AVX512 = 3    /* at most AVX-512F (16-float vectors, 32 registers) */
} ac_cpu_isa;

typedef struct {
  ac_backend_kind kind;
  /* CPU: the backend's threads (0: as many as OpenBLAS's setting). Its products run on
   * them as single-threaded OpenBLAS calls, so creating a CPU backend sets OpenBLAS to 1
   * thread (process-wide, as OpenBLAS is). Default 1. Ignored by CUDA. */
  int threads;
  /* CUDA: device ordinal. Default 0. Ignored by CPU. */
  int device;
  /* CPU: cap on the direct kernels' vector ISA (ac_cpu_isa). Default AC_CPU_ISA_BEST.
   * Ignored by CUDA. */
  int cpu_isa;
} ac_backend_opts;

/* Opaque: the backend's state (stream, library handles, scratch). */
typedef struct ac_backend ac_backend;

/* Fills opts with the defaults: CPU, 1 thread, device 0, the processor's best ISA. */
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
int ac_copy2d(ac_backend *be, size_t rows, size_t cols, const float *src, size_t lds, float *dst,
              size_t ldd);

/* Transpose of a C-contiguous tensor of ndim (1..AC_MAX_DIMS) dimensions shape[]: y has
 * shape y_shape[k] = shape[perm[k]] and y[idx] = x[idx'] where idx'[perm[k]] = idx[k].
 * perm must be a permutation of 0..ndim-1. No aliasing.
 * Example: attention heads, (B, T, 3, H, Dh) with perm {2, 0, 3, 1, 4} -> (3, B, H, T, Dh). */
int ac_permute(ac_backend *be, int ndim, const size_t *shape, const int *perm, const float *x,
               float *y);

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
                     float alpha, const float *a, size_t lda, size_t stride_a, const float *b,
                     size_t ldb, size_t stride_b, float beta, float *c, size_t ldc, size_t stride_c,
                     size_t batch);

/* ac_sgemm_batched with batch 1. */
int ac_sgemm(ac_backend *be, ac_trans ta, ac_trans tb, size_t m, size_t n, size_t k, float alpha,
             const float *a, size_t lda, const float *b, size_t ldb, float beta, float *c,
             size_t ldc);

/* Gram matrix into a packed upper triangle (the Shampoo statistics of a block):
 *   trans == AC_NO_TRANS: C = alpha A A^T + beta C, A is n x k (lda >= k): C = G G^T
 *   trans == AC_TRANS:    C = alpha A^T A + beta C, A is k x n (lda >= n): C = G^T G
 * C is n x n symmetric, packed upper (n(n+1)/2 values, ac_packed_len). EMA of statistics:
 * alpha = 1 - beta2, beta = beta2. Block of a larger gradient: a points at its first element
 * with lda the full row stride. No aliasing between A and C. */
int ac_syrk_packed(ac_backend *be, ac_trans trans, size_t n, size_t k, float alpha, const float *a,
                   size_t lda, float beta, float *c_packed);

/* ac_syrk_packed with beta 0 into host memory: C = alpha A A^T (or A^T A) written packed
 * upper at host_packed (ac_packed_len(n) floats the caller owns, e.g. libprecond's push
 * slot), waiting like the other *_to_host calls. The same floats as ac_syrk_packed with beta
 * 0 and a download: the CPU backend writes them there directly, CUDA computes on the
 * device and its download lands there (no staging buffer of the caller's). */
int ac_syrk_packed_to_host(ac_backend *be, ac_trans trans, size_t n, size_t k, float alpha,
                           const float *a, size_t lda, float *host_packed);

/* Packed upper (n(n+1)/2) to dense row-major n x n (ld >= n; both triangles written), and
 * dense (upper triangle read) to packed. For preconditioners fetched packed from precondd. */
int ac_unpack_sym(ac_backend *be, size_t n, const float *packed, float *dense, size_t ld);
int ac_pack_sym(ac_backend *be, size_t n, const float *dense, size_t ld, float *packed);

/* n(n+1)/2 (host helper, no backend). */
size_t ac_packed_len(size_t n);

/* ------------------------------------------------------------------------------------ */
/* Elementwise maps (n elements, contiguous; in-place allowed)                            */

typedef enum {
  AC_BIN_ADD = 0, /* a + b */
  AC_BIN_SUB,     /* a - b */
  AC_BIN_MUL,     /* a * b */
  AC_BIN_DIV      /* a / b (IEEE: x/0 is +-Inf or NaN) */
} ac_binary_op;

/* out[i] = a[i] op b[i]. */
int ac_binary(ac_backend *be, ac_binary_op op, size_t n, const float *a, const float *b,
              float *out);

/* out[i] = alpha x[i] + beta y[i]. axpy: out = y, beta = 1. scale: beta = 0 (y not read,
 * may be NULL). Residual add, gradient accumulation, SGD momentum, Nesterov lookahead. */
int ac_axpby(ac_backend *be, size_t n, float alpha, const float *x, float beta, const float *y,
             float *out);

/* out[i] = alpha x[i] + beta (scalar beta): scale and shift, e.g. var + eps. */
int ac_affine(ac_backend *be, size_t n, float alpha, const float *x, float beta, float *out);

typedef enum {
  AC_UNARY_RELU = 0, /* max(x, 0);                  d/dx: x > 0 ? 1 : 0 */
  AC_UNARY_GELU,     /* tanh form: 0.5x(1 + tanh(s(x + 0.044715x^3))), s = sqrt(2/pi) */
  AC_UNARY_EXP,      /* e^x */
  AC_UNARY_LOG,      /* ln x */
  AC_UNARY_SQRT,     /* sqrt x */
  AC_UNARY_RSQRT,    /* 1/sqrt x */
  AC_UNARY_TANH,
  AC_UNARY_SIGMOID, /* 1/(1+e^-x) */
  AC_UNARY_SQUARE,  /* x^2 */
  AC_UNARY_ABS,     /* |x|;                         d/dx: sign(x), 0 at 0 */
  AC_UNARY_NEG,     /* -x */
  AC_UNARY_RECIP,   /* 1/x */
  AC_UNARY_COUNT
} ac_unary_op;

/* Static name of a unary op ("relu", "gelu", ...); "?" for an unknown value. */
const char *ac_unary_name(ac_unary_op op);

/* out[i] = f(x[i]). */
int ac_unary(ac_backend *be, ac_unary_op op, size_t n, const float *x, float *out);

/* Backward of ac_unary: dx[i] = dy[i] f'(x[i]), with x the forward INPUT. dx may alias dy
 * (or x). */
int ac_unary_backward(ac_backend *be, ac_unary_op op, size_t n, const float *x, const float *dy,
                      float *dx);

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
  AC_REDUCE_SUM = 0, /* sum */
  AC_REDUCE_SUMSQ,   /* sum of squares */
  AC_REDUCE_MAX,     /* maximum (-Inf for an empty set) */
  AC_REDUCE_NORM2    /* sqrt of the sum of squares */
} ac_reduce_op;

/* out[m] = alpha * R_{o,i} x[o][m][i] + beta * out[m], R the reduction op. beta = 0
 * overwrites; beta = 1 accumulates (bias gradients over micro-batches). out has mid values
 * and must not alias x. Accumulation precision and order are backend-specific (CPU: double,
 * CUDA: float per thread, then a tree): results agree across backends to rounding, not
 * bitwise. */
int ac_reduce(ac_backend *be, ac_reduce_op op, size_t outer, size_t mid, size_t inner, float alpha,
              const float *x, float beta, float *out);

/* Per-channel passes of batch normalisation, on the same (outer, mid, inner) view with mid
 * the channel ((N, C, H*W) for images). Each walks the tensor once where the ac_reduce /
 * ac_bcast recipe walks it 3 to 6 times, and folds in the ReLU and residual add that follow
 * a batch norm in a ResNet block. Sums are in double on the CPU (in a fixed order: results
 * do not depend on the thread count), float per thread then a tree on CUDA. */

/* mean[m] and the biased variance var[m] of the outer*inner values of channel m (var from
 * the double sums of x and x^2, clamped at 0). No aliasing. */
int ac_channel_moments(ac_backend *be, size_t outer, size_t mid, size_t inner, const float *x,
                       float *mean, float *var);

/* y = x scale[m] + shift[m] (+ res, when res is not NULL), then max(., 0) when relu != 0:
 * batch norm's output (scale = gamma rstd, shift = beta - mean scale), the residual add and
 * the ReLU in one pass. y may alias x or res. */
int ac_channel_affine(ac_backend *be, size_t outer, size_t mid, size_t inner, const float *x,
                      const float *scale, const float *shift, const float *res, int relu, float *y);

/* The sums of batch norm's backward, with g = dy where mask is NULL or mask > 0, else 0
 * (mask: the output of a fused ReLU): sum_g[m] = sum of g, sum_gx[m] = sum of
 * g (x - center[m]) over channel m; g itself is written to gout when it is not NULL (the
 * gradient a fused residual add hands on). gout may alias dy; nothing else aliases. */
int ac_channel_grad_sums(ac_backend *be, size_t outer, size_t mid, size_t inner, const float *dy,
                         const float *mask, const float *x, const float *center, float *gout,
                         float *sum_g, float *sum_gx);

/* dx = a[m] g + b[m] x + c[m], g masked as in ac_channel_grad_sums (mask may be NULL);
 * b and c may be NULL (zero): batch norm's input gradient in one pass. dx may alias dy or
 * x. */
int ac_channel_combine(ac_backend *be, size_t outer, size_t mid, size_t inner, const float *dy,
                       const float *mask, const float *x, const float *a, const float *b,
                       const float *c, float *dx);

/* Reductions of n contiguous values to a host double (waits for earlier work):
 * sum and sum of squares. For global-norm clipping and grafting norms: a norm is
 * sqrt(sumsq). out is a HOST pointer. */
int ac_sum_to_host(ac_backend *be, size_t n, const float *x, double *out);
int ac_sumsq_to_host(ac_backend *be, size_t n, const float *x, double *out);

/* index of the largest value of each row of x (rows x cols, contiguous) into idx[rows]
 * (device int32; the first index on ties; cols >= 1). For accuracy. */
int ac_argmax_rows(ac_backend *be, size_t rows, size_t cols, const float *x, int32_t *idx);

/* One categorical draw per row (K-FAC's model Fisher: labels from the predictive
 * distribution): labels[r] = the first j with u[r] S_r < p[r][0] + ... + p[r][j], where
 * S_r = the row's sum, accumulated in float in column order (the same on every backend, so
 * a draw is bit-identical across them). probs: rows x cols, contiguous, >= 0 (a softmax
 * output); u: rows uniforms in [0, 1) (ac_rand_uniform); labels: device int32, in/out: a
 * row whose label on entry is outside [0, cols) (a loss's ignored row) keeps it, so is a
 * row whose sum is not positive and finite; rounding past the last positive entry takes it. */
int ac_sample_rows(ac_backend *be, size_t rows, size_t cols, const float *probs, const float *u,
                   int32_t *labels);

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
                      const float *gamma, const float *beta, float *y, float *mean, float *rstd);

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
int ac_gather_rows(ac_backend *be, size_t n, size_t cols, const float *table, size_t table_rows,
                   const int32_t *idx, float *out);

/* table[idx[r]][:] += src[r][:] for r < n (repeated indices add up; order, and therefore
 * rounding, is backend-specific). An index outside [0, table_rows) is skipped. The embedding
 * gradient: zero the table gradient first. No aliasing. */
int ac_scatter_add_rows(ac_backend *be, size_t n, size_t cols, const float *src, const int32_t *idx,
                        float *table, size_t table_rows);

/* ------------------------------------------------------------------------------------ */
/* Convolution and pooling (NCHW)                                                         */

typedef struct {
  size_t n, c, h, w;         /* input batch, channels, height, width */
  size_t kh, kw;             /* kernel (or pooling window) height and width, >= 1 */
  size_t stride_h, stride_w; /* >= 1 */
  size_t pad_h, pad_w;       /* zero padding on each side; < kernel size */
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

/* Direct 3x3 convolution, stride 1, padding 1 (the output is h x w), NCHW, without a column
 * matrix: y (n, oc, h, w) = the conv of x (n, c, h, w) with wt (oc, c, 3, 3), overwritten.
 * The input gradient of such a conv is the same conv of dy with the weights transposed and
 * flipped (wt'[ch][o][t] = wt[o][ch][8 - t]). Within float rounding of im2col + gemm, and
 * the same bits for any thread count. AC_ENOTSUP where ac_conv3x3_supported says no. No
 * aliasing. */
int ac_conv3x3(ac_backend *be, size_t n, size_t c, size_t oc, size_t h, size_t w, const float *x,
               const float *wt, float *y);

/* y = ac_conv3x3 of x + res (res (n, oc, h, w); it may alias y, not x): the add made while
 * y is written, the same bits as ac_conv3x3 then ac_binary(AC_BIN_ADD). A ResNet block's
 * input gradient: the first conv's (a conv of dy) plus the shortcut's, in one pass. Same
 * support. */
int ac_conv3x3_add(ac_backend *be, size_t n, size_t c, size_t oc, size_t h, size_t w,
                   const float *x, const float *wt, const float *res, float *y);

/* ac_conv3x3, and batch norm's moments of y with it: moments[o] the mean and moments[oc + o]
 * the biased variance of y's channel o over the n images (2 oc floats), the same bits as
 * ac_channel_moments(n, oc, h w) of y gives, made while each image's planes are still in
 * the cache (one pass over the activations less per conv + batch norm). Same support;
 * moments aliases nothing. */
int ac_conv3x3_moments(ac_backend *be, size_t n, size_t c, size_t oc, size_t h, size_t w,
                       const float *x, const float *wt, float *y, float *moments);

/* The batch norm whose backward an input gradient feeds (ac_conv3x3_bn_grad): its fused
 * ReLU's output mask (NULL: no ReLU), its input x and the centre of its sums (its batch mean
 * in training, running mean in eval), all (n, oc, h, w) but center (oc); and sums, the 2 oc
 * floats written: sum g, then sum g (x - center), per channel. */
typedef struct ac_bn_grad_args {
  const float *mask, *x, *center;
  float *sums;
} ac_bn_grad_args;

/* ac_conv3x3 of x (+ res, when not NULL, as ac_conv3x3_add), then batch norm's backward
 * in the copy-out: y = g, the result masked (0 where bn->mask <= 0), and bn->sums the bits
 * ac_channel_grad_sums(n, oc, h w) gives for the unmasked result with bn's mask, x and
 * center, made while each image's planes are in the cache (one read of the gradient and
 * the mask's pass less per batch norm). A ResNet's stride-1 input gradients, which all
 * feed a batch norm + ReLU. Same support as ac_conv3x3 (CUDA: AC_ENOTSUP, the layer makes
 * the sums itself). res may alias y; bn's buffers alias nothing written. */
int ac_conv3x3_bn_grad(ac_backend *be, size_t n, size_t c, size_t oc, size_t h, size_t w,
                       const float *x, const float *wt, const float *res, float *y,
                       const ac_bn_grad_args *bn);

/* dw (oc, c, 3, 3) += the weight gradient of ac_conv3x3: for every image, channel pair and
 * tap (p, q), the sum over outputs (y, x) of dy[o][y][x] x[ch][y + p - 1][x + q - 1] (zero
 * outside). Same support and guarantees as ac_conv3x3. */
int ac_conv3x3_wgrad(ac_backend *be, size_t n, size_t c, size_t oc, size_t h, size_t w,
                     const float *x, const float *dy, float *dw);

/* 1 if the backend has the direct kernels for c input and oc output channels (the CPU
 * backend: on a processor with AVX2 and FMA, oc a multiple of 4, unless opts.cpu_isa caps it
 * at AC_CPU_ISA_PORTABLE; AVX-512F kernels where the processor has it; CUDA: none yet),
 * else 0. */
int ac_conv3x3_supported(ac_backend *be, size_t c, size_t oc);

/* Direct stride-2 convolution, NCHW, without a column matrix (a ResNet's downsampling
 * convs): k 3 with padding 1, or k 1 without padding, of an input of even size h x w: y (n,
 * oc, h/2, w/2) = the conv of x (n, c, h, w) with wt (oc, c, k, k), overwritten. Within
 * float rounding of im2col + gemm, and the same bits for any thread count. AC_ENOTSUP where
 * ac_conv_s2_supported says no. No aliasing. */
int ac_conv_s2(ac_backend *be, size_t n, size_t c, size_t oc, size_t h, size_t w, size_t k,
               const float *x, const float *wt, float *y);

/* ac_conv_s2 and the moments of its output (2 oc floats), as ac_conv3x3_moments. */
int ac_conv_s2_moments(ac_backend *be, size_t n, size_t c, size_t oc, size_t h, size_t w, size_t k,
                       const float *x, const float *wt, float *y, float *moments);

/* dw (oc, c, k, k) += the weight gradient of ac_conv_s2 for dy (n, oc, h/2, w/2). Same
 * support and guarantees. */
int ac_conv_s2_wgrad(ac_backend *be, size_t n, size_t c, size_t oc, size_t h, size_t w, size_t k,
                     const float *x, const float *dy, float *dw);

/* dx (n, c, h, w) = the input gradient of ac_conv_s2 for dy (n, oc, h/2, w/2), overwritten.
 * Same support and guarantees. */
int ac_conv_s2_dgrad(ac_backend *be, size_t n, size_t c, size_t oc, size_t h, size_t w, size_t k,
                     const float *dy, const float *wt, float *dx);

/* ac_conv_s2_dgrad, then dx += res (res NULL: nothing added; it may alias nothing written)
 * and batch norm's backward in the same pass as ac_conv3x3_bn_grad: dx masked, bn->sums (2 c
 * floats) the bits of ac_channel_grad_sums(n, c, h w) of the unmasked dx + res, each
 * image's planes summed once complete, from the cache. A ResNet block's input gradient at
 * a stride-2 block. Same support (CUDA: AC_ENOTSUP). */
int ac_conv_s2_dgrad_bn(ac_backend *be, size_t n, size_t c, size_t oc, size_t h, size_t w, size_t k,
                        const float *dy, const float *wt, const float *res, float *dx,
                        const ac_bn_grad_args *bn);

/* 1 if the backend has the direct stride-2 kernels for this shape (the CPU backend: where
 * ac_conv3x3_supported(be, c, oc) says yes, c also a multiple of 4, h and w even, k 1 or 3;
 * CUDA: none yet), else 0. */
int ac_conv_s2_supported(ac_backend *be, size_t c, size_t oc, size_t h, size_t w, size_t k);

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
int ac_pool2d_backward(ac_backend *be, ac_pool_op op, const ac_conv2d_geom *g, const float *dy,
                       const int32_t *argmax, float *dx);

/* ------------------------------------------------------------------------------------ */
/* Random numbers: counter-based, so every backend gives the same numbers                  */
/*                                                                                          */
/* Element i of a call uses the counter c = offset + i and the 64-bit splitmix64 finaliser  */
/* of seed + (c + 1) * 0x9E3779B97F4A7C15; u = (z >> 40) * 2^-24 in [0, 1). Integer work    */
/* only, so uniforms (and dropout masks) are bit-identical across backends; normals use    */
/* log/cos and agree to a few ulps. Advance offset by n between calls for fresh numbers.   */

/* out[i] = lo + (hi - lo) u_i. */
int ac_rand_uniform(ac_backend *be, uint64_t seed, uint64_t offset, size_t n, float lo, float hi,
                    float *out);

/* out[i] = mean + std * sqrt(-2 ln(1 - u_i)) cos(2 pi v_i), v_i from the low 24 bits of z. */
int ac_rand_normal(ac_backend *be, uint64_t seed, uint64_t offset, size_t n, float mean, float std,
                   float *out);

/* Inverted dropout mask: mask[i] = u_i >= p ? 1 / (1 - p) : 0, 0 <= p < 1. Then y = x * mask
 * and dx = dy * mask with ac_binary(MUL). */
int ac_dropout_mask(ac_backend *be, uint64_t seed, uint64_t offset, size_t n, float p, float *mask);

/* ------------------------------------------------------------------------------------ */
/* Fused optimizer step                                                                   */

typedef struct {
  float lr;           /* learning rate */
  float beta1, beta2; /* moment decays, in [0, 1) */
  float eps;          /* > 0 */
  float weight_decay; /* decoupled (AdamW): p -= lr * wd * p; 0 for Adam */
  long step;          /* 1-based step count, for the bias corrections 1 - beta^step */
} ac_adamw_args;

/* AdamW on n values, in place: m = b1 m + (1-b1) g; v = b2 v + (1-b2) g^2;
 * p -= lr (m / (1 - b1^t) / (sqrt(v / (1 - b2^t)) + eps) + wd p). p, g, m, v distinct. */
int ac_adamw_update(ac_backend *be, size_t n, float *p, const float *g, float *m, float *v,
                    const ac_adamw_args *args);

/* The coefficients of ac_moment_graft, as the caller rounded them to float (the caller
 * owns the bias corrections, so that the fused pass repeats its unfused arithmetic). */
typedef struct {
  float f_new, f_keep; /* first moment: f = f_new g + f_keep f */
  float x_g, x_f;      /* the step's gradient: x = x_g g + x_f f (of the updated f) */
  float v_new, v_keep; /* second moment: v = v_new g^2 + v_keep v */
  float v_scale, eps;  /* the graft: d = x / (sqrt(v_scale v) + eps), eps > 0 */
} ac_moment_graft_args;

/* Shampoo's first moment and Adam (or RMSprop) graft in one pass over n values, instead of
 * eight primitives: the filtered gradient f and second moment v updated in place, x the
 * step's gradient (bias-corrected or Nesterov first moment) and d the grafted direction,
 * each element with the same float operations as the unfused chain (x_g == 0 skips the g
 * term, as ac_axpby skips a zero beta). g, f, v, x and d are distinct. */
int ac_moment_graft(ac_backend *be, size_t n, const float *g, float *f, float *v, float *x,
                    float *d, const ac_moment_graft_args *args);

/* ------------------------------------------------------------------------------------ */
/* Tensors and named parameters                                                           */

#define AC_MAX_DIMS 6

typedef enum { AC_F32 = 0, AC_I32 = 1 } ac_dtype;

/* A device tensor: C-contiguous data of numel elements. Fields are read-only for users;
 * set them with the functions below. */
typedef struct {
  ac_backend *be; /* the backend holding data (not owned) */
  ac_dtype dtype;
  int ndim;                  /* 0 (scalar: numel 1) .. AC_MAX_DIMS */
  size_t shape[AC_MAX_DIMS]; /* unused entries are 1 */
  size_t numel;
  void *data; /* device pointer; NULL when numel == 0 */
  int owns;   /* 1 if ac_tensor_destroy frees data */
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
  char *name;      /* owned copy */
  ac_tensor value; /* f32 */
  ac_tensor grad;  /* f32, same shape; zeroed at init */
} ac_param;

/* Allocates value and grad (both zero) and copies name (non-empty, < 256 bytes). Free with
 * ac_param_destroy; on error p is left empty. */
int ac_param_init(ac_param *p, ac_backend *be, const char *name, int ndim, const size_t *shape);
void ac_param_destroy(ac_param *p);

#ifdef __cplusplus
}
#endif

#endif /* PRECOND_ACCEL_BACKEND_H */
