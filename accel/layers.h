/*
 * layers.h -- accel's layers and model blocks, written against the primitives of backend.h.
 * Part of accel's public API: include accel.h (or this header alone for layers and models).
 */
#ifndef PRECOND_ACCEL_LAYERS_H
#define PRECOND_ACCEL_LAYERS_H

#include "backend.h"

#ifdef __cplusplus
extern "C" {
#endif

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

/* Curvature hooks (K-FAC, docs/kfac.md): a dense, conv or batch-norm layer with a hook set
 * calls it during backward with read access to what a curvature estimate needs, in the
 * layer's own buffers (no copy is made for the hook; with no hook set the layer does
 * exactly what it did without). The pointers are device memory, read-only and valid only
 * during the call; the hook may use the layer's backend, and decides itself whether this
 * step needs anything (a K-FAC worker computes factors every few steps only).
 * - AC_HOOK_DENSE (ac_linear, at the start of backward): a = the layer input, rows x in
 *   (row stride lda); g = the output gradient, rows x out (row stride ldg). batch = rows.
 * - AC_HOOK_CONV (ac_conv2d, once per im2col chunk, chunks in order, first = the chunk's
 *   first image, 0 for the first chunk of a step): a = the chunk's im2col columns as
 *   ac_im2col_batch lays them out, in = c k k rows of cols = nimg npos values (row stride
 *   lda); g = the chunk's output gradient channel-major, out rows of cols values (row
 *   stride ldg; the layout the weight gradient's gemm reads). batch = images of the step.
 * - AC_HOOK_BATCHNORM (ac_batchnorm, at the start of backward): g = the gradient of the
 *   layer's output (batch, c, hw) as backward received it; relu_y = the layer's output
 *   when a ReLU is fused (the gradient at the affine output is g where relu_y > 0), else
 *   NULL; bn = the layer (ac_batchnorm_xhat gives the normalised input). in = out = c,
 *   npos = hw.
 * weight and bias identify the layer (bias NULL when it has none). A non-zero return is
 * an AC_E* code that fails the backward pass with it. */
typedef enum { AC_HOOK_DENSE = 0, AC_HOOK_CONV = 1, AC_HOOK_BATCHNORM = 2 } ac_hook_kind;

struct ac_batchnorm;

typedef struct {
  ac_hook_kind kind;
  const ac_param *weight, *bias;
  size_t batch, first, nimg; /* conv: images of the step, the chunk's first, its count */
  size_t rows, cols;         /* dense: rows (cols = 0); conv: cols = nimg npos */
  size_t in, out, npos;
  const float *a, *g, *relu_y;
  size_t lda, ldg;
  struct ac_batchnorm *bn;
} ac_hook_view;

typedef struct {
  int (*fn)(void *ctx, const ac_hook_view *view); /* NULL: no hook */
  void *ctx;                                      /* the hook's own, passed back */
} ac_hook;

/* Batch norm across data-parallel workers (sync BN): with fn set, a batch norm in training
 * mode normalises with the statistics of the whole global batch, not of this worker's
 * share, by two calls per step: forward, fn averages over the workers each channel's mean
 * and mean square of the share; backward, the sums of the output gradient and of it times
 * the normalised input (the weight and bias gradients stay the share's: the caller
 * averages gradients anyway). fn replaces the n floats at v (device memory, the layer's,
 * valid during the call) by their mean over the workers, every worker's share being the
 * same size; workers is their count (for the running variance's unbiasing). The reduction
 * is the caller's (the trainer's MPI), so accel needs none. fn NULL (default): the share
 * alone. A non-zero return is an AC_E* code that fails the pass with it. */
typedef struct {
  int (*fn)(void *ctx, float *v, size_t n);
  void *ctx;
  int workers;
} ac_bn_sync;

/* Linear: y = x W^T + b, x (rows, in), W (out, in) "<p>.weight", b (out) "<p>.bias" (when
 * bias != 0). W ~ U(-1/sqrt(in), 1/sqrt(in)), b = 0. hook: see the curvature hooks above
 * (set it directly; zero after init). */
typedef struct {
  ac_backend *be;
  size_t in, out, max_rows, rows;
  int has_bias, ready;
  ac_param weight, bias;
  const float *x;
  float *y, *dx;
  ac_hook hook;
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

int ac_embedding_init(ac_embedding *l, ac_backend *be, const char *prefix, size_t vocab, size_t dim,
                      size_t max_rows, uint64_t seed);
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

int ac_posembed_init(ac_posembed *l, ac_backend *be, const char *prefix, size_t max_t, size_t dim,
                     size_t max_batch, uint64_t seed);
void ac_posembed_destroy(ac_posembed *l);
int ac_posembed_params(ac_posembed *l, ac_param_list *list);
int ac_posembed_forward(ac_posembed *l, const float *x, size_t batch, size_t t, const float **y);
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

int ac_layernorm_init(ac_layernorm *l, ac_backend *be, const char *prefix, size_t dim, float eps,
                      size_t max_rows);
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
int ac_residual_forward(ac_residual *l, const float *a, const float *b, size_t n, const float **y);
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

int ac_attention_init(ac_attention *l, ac_backend *be, const char *prefix, size_t dim, size_t heads,
                      size_t max_t, size_t max_batch, uint64_t seed);
void ac_attention_destroy(ac_attention *l);
int ac_attention_params(ac_attention *l, ac_param_list *list);
int ac_attention_forward(ac_attention *l, const float *x, size_t batch, size_t t, const float **y);
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
 * recomputes im2col rather than keeping it. The input gradient of a stride-1 conv is
 * itself a stride-1 conv (of dy with the weights transposed and flipped, padding k-1-pad):
 * im2col of dy and one gemm with K = out_c k k, no col2im, when its columns and products
 * fit the workspace ((out_c k k + in_c) h w <= (in_c k k + out_c) oh ow per image, true
 * for every conv with in_c == out_c); otherwise W^T dy and col2im. A 3x3 stride-1 pad-1
 * conv runs on the backend's direct kernels instead (ac_conv3x3, ac_conv3x3_wgrad; no
 * workspace used) where ac_conv3x3_supported says so, and so do a 3x3 stride-2 pad-1 conv
 * and a 1x1 stride-2 pad-0 one (ac_conv_s2 and its gradients) where ac_conv_s2_supported
 * says so; except dW under a curvature hook. */
typedef struct {
  ac_backend *be;
  ac_conv2d_geom g; /* g.n is max_batch */
  size_t out_c, oh, ow, chunk, batch;
  int has_bias, ready, owns_ws;
  int direct, direct_dx; /* the backend's direct 3x3 kernels (ac_conv3x3) for y and dW; dx */
  int direct_s2;         /* the backend's direct stride-2 kernels (ac_conv_s2): y, dW and dx */
  int dx_as_conv;        /* otherwise dx as im2col of dy + one gemm (it fits the workspace) */
  ac_param weight, bias;
  const float *x;
  float *ws, *y, *dx;
  float *wflip;   /* stride-1 dx as a conv: W permuted (in_c, out_c, k k), then flipped */
  float *moments; /* ac_conv2d_want_moments: the last forward's output moments, or NULL */
  int want_moments, moments_ready;
  ac_hook hook; /* curvature hook (see above); zero after init */
} ac_conv2d;

size_t ac_conv2d_workspace_floats(size_t in_c, size_t out_c, size_t k, size_t oh, size_t ow,
                                  size_t chunk);
int ac_conv2d_init(ac_conv2d *l, ac_backend *be, const char *prefix, size_t in_c, size_t out_c,
                   size_t h, size_t w, size_t k, size_t stride, size_t pad, int bias,
                   size_t max_batch, size_t chunk, float *workspace, uint64_t seed);
void ac_conv2d_destroy(ac_conv2d *l);
int ac_conv2d_params(ac_conv2d *l, ac_param_list *list);
int ac_conv2d_forward(ac_conv2d *l, const float *x, size_t batch, const float **y);
int ac_conv2d_backward(ac_conv2d *l, const float *dy, const float **dx);
/* Backward with the input gradient plus addend (batch in_c h w floats; it may alias out)
 * written to the caller's out (batch in_c h w floats) instead of the layer's buffer: a
 * residual block's two input-gradient branches summed while the direct stride-1 kernel
 * writes (ac_conv3x3_add), else by one more pass. */
int ac_conv2d_backward_add(ac_conv2d *l, const float *dy, const float *addend, float *out);
struct ac_batchnorm;
/* ac_conv2d_backward (addend NULL; out unused) or ac_conv2d_backward_add (into out) for a
 * conv whose input was bn's output (through bn's fused ReLU, if any); *dx = the input
 * gradient. Where the backend's direct kernels make it (ac_conv3x3_bn_grad at stride 1,
 * ac_conv_s2_dgrad_bn at stride 2, the latter not with addend == out), it
 * comes out masked by bn's ReLU and bn's backward sums are made while it is written: bn's
 * next backward of this *dx (ac_batchnorm_backward_res) uses them and skips its own pass
 * over it (the parameter gradients and dx the same bits as without). Otherwise, or with bn
 * NULL, the plain call. bn's forward must have run for this batch. */
int ac_conv2d_backward_bn(ac_conv2d *l, const float *dy, const float *addend, float *out,
                          struct ac_batchnorm *bn, const float **dx);
/* For a batch norm that follows: from now on forward also makes its output's per-channel
 * mean and biased variance where the backend's direct kernels can do it while writing y
 * (ac_conv3x3_moments, ac_conv_s2_moments; no bias), and ac_conv2d_moments hands them out
 * (2 out_c floats, layer-owned, valid until the next forward), else NULL. */
int ac_conv2d_want_moments(ac_conv2d *l);
const float *ac_conv2d_moments(const ac_conv2d *l);

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
typedef struct ac_batchnorm {
  ac_backend *be;
  size_t c, hw, max_batch, batch;
  float eps, momentum;
  int ready, relu;
  ac_mode mode;
  ac_param weight, bias;
  ac_tensor running_mean, running_var;
  const float *x;
  float *y, *dx, *dres, *mean, *rstd, *s1, *s2, *coef;
  float *gsums;           /* 2 c: backward's sums, made by the conv that wrote gsums_for */
  const float *gsums_for; /* NULL, or the gradient they are for (ac_conv2d_backward_bn) */
  ac_hook hook;           /* curvature hook (see above); zero after init */
  ac_bn_sync sync;        /* sync BN (see above); zero after init */
} ac_batchnorm;

int ac_batchnorm_init(ac_batchnorm *l, ac_backend *be, const char *prefix, size_t c, size_t hw,
                      float eps, float momentum, size_t max_batch);
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
/* ac_batchnorm_forward_res with x's batch moments already made (ac_conv2d_moments: the mean
 * of each channel, then its biased variance; 2 c floats), so that training mode skips its
 * own pass over x; NULL: as forward_res. Unused in eval mode. */
int ac_batchnorm_forward_moments(ac_batchnorm *l, const float *x, const float *res,
                                 const float *moments, size_t batch, ac_mode mode, const float **y);
int ac_batchnorm_backward(ac_batchnorm *l, const float *dy, const float **dx);
/* dres may be NULL (then this is ac_batchnorm_backward); dx may be NULL too. */
int ac_batchnorm_backward_res(ac_batchnorm *l, const float *dy, const float **dx,
                              const float **dres);

/* Max or average pooling (ac_pool2d_forward) of x (n, c, h, w), window k, stride, pad. */
typedef struct {
  ac_backend *be;
  ac_pool_op op;
  ac_conv2d_geom g; /* g.n is max_batch */
  size_t oh, ow, batch;
  int ready;
  int32_t *argmax;
  float *y, *dx;
} ac_pool;

int ac_pool_init(ac_pool *l, ac_backend *be, ac_pool_op op, size_t c, size_t h, size_t w, size_t k,
                 size_t stride, size_t pad, size_t max_batch);
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

/* Weight initialisation of a model's linear or conv layers, chosen in the model config.
 * AC_INIT_LAYER keeps each layer's own (linear U(-1/sqrt(in), 1/sqrt(in)); conv He fan-in,
 * N(0, 2 / (in_c k k))). AC_INIT_NORMAL002 (Transformer linears, as GPT-2): N(0, 0.02^2).
 * AC_INIT_HE_FAN_OUT (ResNet convs, He et al. 2015 as torchvision's ResNet):
 * N(0, 2 / (out_c k k)). Biases stay 0. */
typedef enum { AC_INIT_LAYER = 0, AC_INIT_NORMAL002 = 1, AC_INIT_HE_FAN_OUT = 2 } ac_init;

/* Decoder-only Transformer language model: token embedding "tok" + learned positional
 * embedding "pos", `layers` blocks "layer<i>", final layer norm "lnf", linear head "head"
 * (dim -> vocab, with bias), softmax cross-entropy against targets. With tie_head the
 * head's weight is the embedding matrix itself (as GPT-2): no "head.weight" parameter, and
 * "tok.weight"'s gradient is the sum of its two uses. init: AC_INIT_LAYER or
 * AC_INIT_NORMAL002 for every linear (attention, MLP, an untied head). */
typedef struct {
  size_t vocab, ctx, dim, heads, layers, mlp, batch;
  float dropout;
  uint64_t seed;
  int tie_head;
  ac_init init;
} ac_lm_config;

/* The benchmark client's model: vocab 256, ctx 64, dim 128, 4 heads, 2 layers, mlp 512,
 * batch 32, dropout 0, seed 1, tied head, linears N(0, 0.02^2) (docs/benchmarks.md has the
 * measurements behind the last two). */
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
  const float *logits; /* (batch * t, vocab) of the last forward, owned by head */
} ac_lm;

int ac_lm_init(ac_lm *m, ac_backend *be, const ac_lm_config *cfg);
void ac_lm_destroy(ac_lm *m);
int ac_lm_params(ac_lm *m, ac_param_list *list);
/* tokens and targets: device int32 (batch, t), caller-owned and kept until backward;
 * *loss (host) is the mean cross-entropy over targets inside [0, vocab). */
int ac_lm_forward(ac_lm *m, const int32_t *tokens, const int32_t *targets, size_t batch, size_t t,
                  ac_mode mode, double *loss);
/* Adds d(mean loss)/d(param) to every grad. */
int ac_lm_backward(ac_lm *m);
/* Sets hook on every linear layer of the model: attention qkv and proj, MLP fc1 and fc2,
 * and the head when it is not tied (a zero hook clears them). Embeddings and layer norms
 * have no hook. */
void ac_lm_set_hook(ac_lm *m, const ac_hook *hook);

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

size_t ac_basicblock_workspace_floats(size_t in_c, size_t out_c, size_t h, size_t w, size_t stride,
                                      size_t chunk);
int ac_basicblock_init(ac_basicblock *b, ac_backend *be, const char *prefix, size_t in_c,
                       size_t out_c, size_t h, size_t w, size_t stride, size_t max_batch,
                       size_t chunk, float *workspace, uint64_t seed);
void ac_basicblock_destroy(ac_basicblock *b);
int ac_basicblock_params(ac_basicblock *b, ac_param_list *list);
int ac_basicblock_forward(ac_basicblock *b, const float *x, size_t batch, ac_mode mode,
                          const float **y);
int ac_basicblock_backward(ac_basicblock *b, const float *dy, const float **dx);
/* ac_basicblock_backward for a block whose input x was in_bn's output (through in_bn's
 * fused ReLU): *dx comes with in_bn's backward sums where conv1's kernel can make them
 * (ac_conv2d_backward_bn), for in_bn's backward of *dx next. in_bn NULL: the plain call. */
int ac_basicblock_backward_bn(ac_basicblock *b, const float *dy, ac_batchnorm *in_bn,
                              const float **dx);

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
  ac_init conv_init; /* AC_INIT_LAYER (He fan-in) or AC_INIT_HE_FAN_OUT, every conv */
} ac_resnet_config;

/* The benchmark client's ResNet-20 for 28x28x1: 3 stages of 3 blocks, widths 16/32/64,
 * 10 classes, batch 128, im2col chunk 8 images, bn eps 1e-5, momentum 0.1, seed 1, convs
 * He fan-out. */
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
  const float *logits; /* (batch, classes) of the last forward, owned by fc */
} ac_resnet;

int ac_resnet_init(ac_resnet *m, ac_backend *be, const ac_resnet_config *cfg);
void ac_resnet_destroy(ac_resnet *m);
int ac_resnet_params(ac_resnet *m, ac_param_list *list);
/* images: device (batch, in_c, h, w); labels: device int32 (batch); both caller-owned and
 * kept until backward. *loss (host): mean cross-entropy. */
int ac_resnet_forward(ac_resnet *m, const float *images, const int32_t *labels, size_t batch,
                      ac_mode mode, double *loss);
int ac_resnet_backward(ac_resnet *m);
/* Sets hook on every conv, batch norm and the linear head of the model (a zero hook
 * clears them). */
void ac_resnet_set_hook(ac_resnet *m, const ac_hook *hook);
/* Sets the sync BN reduction (ac_bn_sync above) on every batch norm of the model (NULL
 * clears it). */
void ac_resnet_set_sync(ac_resnet *m, const ac_bn_sync *sync);

/* ---- end of layers ---- */

#ifdef __cplusplus
}
#endif

#endif /* PRECOND_ACCEL_LAYERS_H */
