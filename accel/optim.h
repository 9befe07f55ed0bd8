/*
 * optim.h -- accel's optimizers, learning-rate schedules, Shampoo's worker half, the K-FAC
 * worker kernels and ABS's Hessian-vector products, written against the primitives of
 * backend.h. Part of accel's public API: include accel.h (or this header alone for the
 * optimizers).
 */
#ifndef PRECOND_ACCEL_OPTIM_H
#define PRECOND_ACCEL_OPTIM_H

#include "backend.h"

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

#ifdef __cplusplus
extern "C" {
#endif

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
  AC_LR_CONSTANT = 0, /* base_lr after the warmup */
  AC_LR_COSINE,       /* ac_lr_cosine_decay over decay_steps after the warmup */
  AC_LR_STEP          /* ac_lr_step_decay: times gamma every step_size steps after it */
} ac_lr_decay;

/* A warmup followed by a decay. At step t >= 1: t <= warmup_steps gives
 * ac_lr_linear_warmup(base_lr, t, warmup_steps); after it the decay runs on
 * s = t - warmup_steps (so the decay starts from base_lr exactly where the warmup ends). */
typedef struct {
  double base_lr;    /* > 0 */
  long warmup_steps; /* >= 0 */
  ac_lr_decay decay;
  long decay_steps; /* COSINE: > 0 */
  double min_lr;    /* COSINE: in [0, base_lr] */
  long step_size;   /* STEP: > 0 */
  double gamma;     /* STEP: in (0, 1] */
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
  float momentum;     /* mu in [0, 1); 0: plain SGD, no buffer. Default 0.9 */
  int nesterov;       /* 1: Nesterov lookahead (needs momentum > 0). Default 0 */
  float weight_decay; /* >= 0; L2 coupled into the gradient as in classic SGD. Default 0 */
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
int ac_sgd_create(ac_sgd **out, ac_param *const *params, size_t nparams, const ac_sgd_opts *opts);

/* One step with learning rate lr (finite, >= 0). Grads are read, not changed. */
int ac_sgd_step(ac_sgd *opt, float lr);

/* Steps taken so far. */
long ac_sgd_steps(const ac_sgd *opt);

/* Frees the optimizer's state (not the parameters). NULL is a no-op. */
void ac_sgd_destroy(ac_sgd *opt);

/* ---- AdamW ---- */

typedef struct {
  float beta1, beta2; /* [0, 1); defaults 0.9, 0.999 */
  float eps;          /* > 0; default 1e-8 */
  float weight_decay; /* >= 0, decoupled: p -= lr wd p; default 0.01 */
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
 *      with ac_shampoo_block_stats and hands to libprecond's push; or
 *      ac_shampoo_compute_stats_into, straight into the caller's memory (push slots);
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
 *       P_b = L_b^(-1/p) M_b R_b^(-1/p) with p = root_exponent, the roots as precondd
 *       computes them (a missing side is the identity; one_sided: only the root of the
 *       smaller side of order > 1), rescaled to
 *       |D_b| (Frobenius; P_b replaced by D_b when |P_b| is 0 or not finite), else
 *       P_b = D_b (the grafted fallback, counted);
 *   buf = mu buf + P;  U = nesterov ? P + mu buf : buf;  p -= lr (U + wd p).
 * Diagonal parameters take U from D (the grafted step is their whole step, not a
 * fallback, and is not counted).
 */

typedef struct {
  pc_layout_opts layout; /* block_size, skip_limit: must match the daemon's. Defaults */
  pc_graft_opts graft;   /* grafting (the step length). Default Adam, its defaults */
  float momentum;        /* mu in [0, 1) on the grafted direction. Default 0 */
  int nesterov;          /* needs momentum > 0. Default 0 */
  float weight_decay;    /* >= 0, decoupled. Default 0 */
  long stats_interval;   /* statistics at steps 1, 1 + k, 1 + 2k, ...; >= 1. Default 1 */
  long start_step;       /* first step that may use roots; >= 1. Default 1 */
  long max_staleness;    /* a root older than this many steps (t - source_step) is not
                             used: the block takes the grafted fallback. 0: no bound.
                             >= 0. Default 0 */
  /* The daemon's: the statistics EMA (1 = sum) and the relative ridge of the roots. Kept
   * here so that one struct configures a run (the caller registers them with precondd);
   * the worker itself hands out raw G G^T increments and does not use them. */
  float beta2;           /* [0, 1]. Default 0.95 */
  double epsilon;        /* > 0. Default 1e-6 */
  float beta1;           /* first moment of the gradient in [0, 1); 0: off (M = G). Not
                             with the normed grafts. Default 0.9 */
  int beta1_nesterov;    /* Nesterov look-ahead of the first moment; needs beta1 > 0.
                             Default 0 */
  int one_sided;         /* 1: apply one root per block (the caller registers root
                             exponent 2, so P_b = L_b^(-1/2) M_b or M_b R_b^(-1/2)).
                             Default 0 */
  pc_method root_method; /* the daemon's, as beta2 and epsilon: how it computes the roots
                             (PC_METHOD_NEWTON or PC_METHOD_EIGH). Default EIGH */
  int root_exponent;     /* the daemon's: p of the roots A^(-1/p) applied on both sides,
                             in [1, 64]; 4 is Shampoo's L^(-1/4) G R^(-1/4), 2 the square
                             root on each side. one_sided always takes p = 2. Default 2 */
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
  size_t param;            /* index into the params given at create */
  size_t index;            /* block within that parameter's layout */
  pc_block block;          /* rows, cols and offsets in the parameter's 2-D view */
  uint64_t version;        /* version of the roots held; 0: none yet */
  uint64_t source_step;    /* their source step (as handed in) */
  uint64_t fallback_steps; /* steps this block took the grafted fallback */
  long staleness;          /* t - source_step at the last step that used the roots; -1:
                               never used */
} ac_shampoo_block;

/* Fills *info for block id b. AC_EINVAL for b out of range or NULL. */
int ac_shampoo_block_info(const ac_shampoo *s, size_t b, ac_shampoo_block *info);

/* Block-steps that took the grafted fallback, summed over blocks. */
uint64_t ac_shampoo_fallback_total(const ac_shampoo *s);

/* What the last step did, for the clients' reports. */
typedef struct {
  long step;             /* its number; 0: no step yet (the rest is then zero) */
  size_t preconditioned; /* blocks that used roots */
  size_t fallback;       /* blocks that took the grafted fallback */
  double staleness_mean; /* over the blocks that used roots; NaN if none did */
  long staleness_max;    /* -1 if none did */
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

/* Whether statistics are due for the coming step t = steps + 1 (1 or 0, as
 * ac_shampoo_compute_stats decides); *step = t (step may be NULL; s NULL: 0). So that a
 * caller gets its destinations (libprecond's push slots) for that step first. */
int ac_shampoo_stats_due(const ac_shampoo *s, long *step);

/* ac_shampoo_compute_stats into the caller's host memory (no buffer of s's in between):
 * when due, block b's packed G G^T goes to left[b] (ac_packed_len(rows) floats) and its
 * G^T G to right[b] (ac_packed_len(cols)), for every block whose left[b] is not NULL
 * (right[b] must then be set too); blocks with NULL are skipped (a data-parallel worker
passes NULL for the blocks another worker computes).
 * The floats are ac_shampoo_compute_stats's (ac_syrk_packed_to_host: the CPU backend
 * writes them there, CUDA's download lands there), all written when it returns. It does
 * not fill s's own buffers: ac_shampoo_block_stats answers AC_EINVAL until the next
 * ac_shampoo_compute_stats. *due, *step and AC_EINVAL (s, left or right NULL when due) as
 * there. */
int ac_shampoo_compute_stats_into(ac_shampoo *s, float *const *left, float *const *right, int *due,
                                  long *step);

/* The host statistics of block b from the last ac_shampoo_compute_stats that computed:
 * *left = packed G G^T (ac_packed_len(rows) values), *right = packed G^T G
 * (ac_packed_len(cols)); owned by s, valid until the next compute or destroy. Either
 * pointer argument may be NULL. AC_EINVAL if b is out of range or nothing was computed yet. */
int ac_shampoo_block_stats(const ac_shampoo *s, size_t b, const float **left, const float **right);

typedef enum {
  AC_ROOT_DENSE = 0, /* n x n row-major */
  AC_ROOT_PACKED = 1 /* packed upper, ac_packed_len(n) values */
} ac_root_format;

/* One version of a block's roots, as a caller hands it in (the fields of libprecond's
 * precond_roots map one to one). left ~ L^(-1/4) of order n_left (= the block's rows),
 * right ~ R^(-1/4) of order n_right (= its cols); a side may be NULL with its n 0
 * (one-sided: the identity there), not both. HOST pointers. */
typedef struct {
  uint64_t version;     /* > 0, increasing per block */
  uint64_t source_step; /* step of the newest statistics the roots come from */
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

/* Forgets block b's roots: it takes the grafted step until ac_shampoo_set_roots hands it
 * a version again (any version: none is held). For a caller that finds, after handing
 * them in, that the roots it read were not intact (libprecond's roots by reference,
 * precond_roots_intact). AC_EINVAL for s NULL or b out of range. */
int ac_shampoo_drop_roots(ac_shampoo *s, size_t b);

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

/* Both of a dense layer's factors, ac_kfac_dense_factor_a's and _g's floats, written packed
 * into host memory the caller owns (ac_syrk_packed_to_host: e.g. libprecond's push slot,
 * where the CPU backend's kernels write them directly and CUDA's download lands):
 * ac_packed_len(in + has_bias) floats at a_host, ac_packed_len(out) at g_host. Waits like
 * the other *_to_host calls. ws: ac_kfac_dense_workspace_floats. */
int ac_kfac_dense_factors_to_host(ac_backend *be, size_t rows, size_t in, size_t out,
                                  const float *a, size_t lda, const float *g, size_t ldg,
                                  int has_bias, float loss_scale, float *a_host, float *g_host,
                                  float *ws);

/* Convolution (KFC, Grosse & Martens 2016), over nimg images of a batch of `batch`, so that a
 * batch im2col'd in chunks accumulates (accumulate 0 for the first chunk, 1 after):
 *   A += (1/(batch npos)) sum_{b,t} [a_bt; 1][a_bt; 1]^T   (the mean over all patches)
 *   G += (1/batch) sum_{b,t} (s dy_bt)(s dy_bt)^T           (per image, summed over positions)
 * col is ac_im2col's (nimg, ckk, npos) with ckk = in_c k k; dy the output gradient (nimg,
 * out_c, npos) NCHW. A (x) G is KFC's Omega (x) Gamma; the split is docs/kfac.md's. */
size_t ac_kfac_conv_workspace_floats(size_t nimg, size_t ckk, size_t npos, int has_bias);
int ac_kfac_conv_factor_a(ac_backend *be, size_t nimg, size_t ckk, size_t npos, const float *col,
                          int has_bias, size_t batch, int accumulate, float *a_packed, float *ws);
int ac_kfac_conv_factor_g(ac_backend *be, size_t nimg, size_t out_c, size_t npos, const float *dy,
                          float loss_scale, size_t batch, int accumulate, float *g_packed);

/* The same conv factors from what conv2d's curvature hook shows (AC_HOOK_CONV, layers.h):
 * one chunk's im2col columns col as ac_im2col_batch lays them out (ckk rows of cols = nimg
 * npos values, row stride ldc) and its output gradient channel-major dyc (out_c rows of cols
 * values, row stride ldd). One syrk each for the whole chunk:
 *   A += (1/(batch npos)) [col; 1][col; 1]^T,   G += (s^2 / batch) dyc dyc^T.
 * ws: ac_kfac_conv_cols_workspace_floats (0 without a bias). */
size_t ac_kfac_conv_cols_workspace_floats(size_t ckk, size_t cols, int has_bias);
int ac_kfac_conv_cols_factor_a(ac_backend *be, size_t ckk, size_t cols, const float *col,
                               size_t ldc, size_t npos, int has_bias, size_t batch, int accumulate,
                               float *a_packed, float *ws);
int ac_kfac_conv_cols_factor_g(ac_backend *be, size_t out_c, size_t cols, const float *dyc,
                               size_t ldd, float loss_scale, size_t batch, int accumulate,
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
int ac_kfac_bn_precondition(ac_backend *be, size_t count, const float *grad, const float *fisher,
                            float damping, float *p, float *ws);

/* The K-FAC update of one layer from the damped inverses (dense on the device):
 * [pw | pb] = g_inv [gw | gb] a_inv, gw and pw out x in, gb and pb out values (both NULL for a
 * layer without bias), g_inv out x out, a_inv order in + (gb != NULL). Two products; pw may
 * be gw and pb gb. ws: ac_kfac_precondition_workspace_floats. */
size_t ac_kfac_precondition_workspace_floats(size_t out, size_t in, int has_bias);
int ac_kfac_precondition(ac_backend *be, size_t out, size_t in, const float *gw, const float *gb,
                         const float *g_inv, const float *a_inv, float *pw, float *pb, float *ws);

/* The same update from the eigen forms (pc_kfac_eigen_*; KAISA's default):
 *   [pw | pb] = Q_G [(Q_G^T [gw | gb] Q_A) / (v_G v_A^T + lambda)] Q_A^T,
 * qg out x out, vg out values, qa and va of order in + (gb != NULL), lambda >= 0 and finite.
 * Four products and an elementwise division; pw may be gw and pb gb. ws:
 * ac_kfac_eigen_precondition_workspace_floats. */
size_t ac_kfac_eigen_precondition_workspace_floats(size_t out, size_t in, int has_bias);
int ac_kfac_eigen_precondition(ac_backend *be, size_t out, size_t in, const float *gw,
                               const float *gb, const float *qg, const float *vg, const float *qa,
                               const float *va, float lambda, float *pw, float *pb, float *ws);

/* One preconditioned tensor and its gradient, for the KL clip (count values each); out, when
 * not NULL, receives the clipped p instead of p itself (it may be grad: the update then
 * replaces the gradient in the same pass, without a copy of p over it). */
typedef struct {
  size_t count;
  float *p;
  const float *grad;
  float *out;
} ac_kfac_pg;

/* KL clip over all layers: nu = pc_kfac_kl_scale(kl_clip, lr, sum_l <p_l, grad_l>), then every
 * p_l *= nu (when nu < 1), in place or into out_l (written whatever nu: nu p_l, or p_l when nu
 * >= 1; the sums are taken before anything is written). *nu (host, may be NULL) gets it. dev1:
 * one device float of scratch. Returns AC_OK; AC_EINVAL (bad arguments, or a non-finite sum:
 * nothing scaled or written, *nu = 0). */
int ac_kfac_kl_clip(ac_backend *be, const ac_kfac_pg *layers, size_t nlayers, double lr,
                    double kl_clip, float *dev1, double *nu);

/* ---- ABS, the worker's half (accel/abs.c; docs/abs.md) ---- */

/* Hessian-vector products by central differences of gradients (the algorithms note,
 * section 4): Hv ~ (grad(w + h v) - grad(w - h v)) / (2 h), for any model whose loss
 * gradient a callback computes. Vectors are device floats over the parameters concatenated
 * in the order given (numel values). The callback is the caller's: it runs the model's
 * forward and backward on a fixed batch (ABS: one batch of hv_batch samples, the model in
 * evaluation mode, so that batch norm uses its running statistics and both evaluations see
 * the same function), adding the gradients into the parameters' grads (zeroed before each
 * call); it returns an AC_E* code. */
typedef struct {
  ac_backend *be;
  ac_param *const *params; /* not owned: the caller keeps the array and the parameters */
  size_t nparams, numel;
  float *w0, *gp; /* device scratch: the weights' copy and grad(w + h v) */
} ac_hvp;

/* Prepares products over params[0..nparams) (f32, one backend): 2 numel floats of device
 * scratch, freed by ac_hvp_destroy. AC_EINVAL (NULL, no parameters or values, mixed
 * backends), AC_ENOMEM; on error *h is empty and destroy is still safe. */
int ac_hvp_init(ac_hvp *h, ac_param *const *params, size_t nparams);
void ac_hvp_destroy(ac_hvp *h);

/* hv = H v by central differences with h = rel_step max(||w||, 1) / ||v|| (*step, may be
 * NULL, gets it): the weights move by rel_step of their norm. Calls grad(ctx) twice. On
 * return, success or not, every weight is its value before the call, bit for bit, and every
 * gradient is zero. v and hv are device memory of numel floats and may not overlap. Returns
 * AC_OK; AC_EINVAL (NULL argument, rel_step not positive and finite, v zero or not finite,
 * weights not finite); the callback's or a primitive's code. */
int ac_hvp_compute(ac_hvp *h, const float *v, double rel_step, int (*grad)(void *ctx), void *ctx,
                   float *hv, double *step);

/* ---- end of optimizers ---- */

#ifdef __cplusplus
}
#endif

#endif /* PRECOND_ACCEL_OPTIM_H */
