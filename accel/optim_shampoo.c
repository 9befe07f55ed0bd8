/*
 * optim_shampoo.c -- Shampoo's worker half (Gupta, Koren, Singer 2018; Anil et al. 2020):
 * statistics G G^T and G^T G of every block computed on the device and handed out packed,
 * roots received from the caller and kept on the device, and the update
 *
 *   M = the first moment of G (beta1 filter, bias-corrected; G itself when beta1 is 0),
 *   P_b = L_b^(-1/4) M_b R_b^(-1/4),  grafted block by block to the norm of a simple
 *   optimizer's direction D of M (Agarwal et al. 2020), then momentum and weight decay.
 *
 * The first moment is Distributed Shampoo's (Shi et al. 2023): one filtered gradient feeds
 * both the Shampoo direction and the graft, while the statistics and the graft's second
 * moment see the raw gradient.
 *
 * The block layout and the grafting rules are the numerics core's (pc_layout_init,
 * pc_graft_*), evaluated here with the backend's primitives instead of host loops. Grafting
 * follows pc_graft_rescale_block_f32's recipe: D over the whole tensor, P per block into
 * contiguous scratch, then each P_b rescaled to |D_b| and written over D_b, so that D ends
 * up holding the step of every block (the grafted fallback where a block has no root).
 */
#include <float.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "optim_internal.h"

typedef struct {
  size_t param, index; /* owner parameter and index in its layout */
  pc_block blk;
  size_t stats_off;     /* left statistic at stats + stats_off, right right after it */
  float *lroot, *rroot; /* dense roots on the device; allocated with the first roots */
  int has_left, has_right;
  uint64_t version, source_step, fallback;
  long staleness; /* at the last step that used the roots; -1: never used */
} shampoo_block;

typedef struct {
  ac_param *p; /* not owned */
  pc_layout layout;
  size_t first_block; /* id of its first block */
  float *m, *v, *buf; /* graft moments and momentum (NULL where unused) */
  float *f;           /* first moment of the gradient (NULL when beta1 is 0) */
} shampoo_param;

struct ac_shampoo {
  ac_backend *be;
  ac_shampoo_opts opts;
  size_t nparams;
  shampoo_param *params;
  size_t nblocks;
  shampoo_block *blocks;
  size_t stats_len;              /* floats of all packed statistics */
  float *stats_dev, *stats_host; /* stats_host is stats_dev on a host-memory backend (CPU) */
  int stats_valid;
  int host_memory;               /* the backend's memory is the host's: no staging copies */
  float *d, *a, *b;              /* scratch of max numel: the direction D and two temporaries */
  float *x;                      /* scratch of max numel: the (filtered) gradient M of the step */
  float *t;                      /* scratch of the largest block: L G_b */
  float *stage;                  /* packed roots on their way to the dense form */
  float *spare[2];               /* host memory: the next dense left and right roots (root_cap) */
  size_t root_cap;               /* host memory: floats of every dense root buffer (the largest
                                    order squared), so that any two can be swapped */
  size_t max_blocks;             /* most blocks of one parameter */
  float *norms_dev, *norms_host; /* |P_b|, |D_b| of one parameter's blocks */
  long steps;
  uint64_t fallback_total;
  ac_shampoo_step_info last; /* what the last step did */
};

/* The one table of Shampoo's defaults (the clients take theirs from here). The measured
 * winners on the main job's Transformer, docs/optimizers.md "Measured defaults": a first
 * moment of 0.9 (bench/train.c's Transformer row takes 0.8, measured there in session 10)
 * under the plain Adam graft (Distributed Shampoo's recipe) instead of
 * momentum on the grafted direction, with Nesterov's look-ahead on it (ahead on two seeds
 * with synchronous roots); square roots on both sides (L^(-1/2) G R^(-1/2): 0.034 lower
 * eval loss at mid-run than Shampoo's 1/4, about 0.52x AdamW's steps to its final loss
 * instead of 0.60x, seeds 1 and 2; measured with eigh roots, which train as Newton's do);
 * coupled Newton roots (eigh, 5x cheaper at order 128, fell behind on small blocks with
 * precondd's two BLAS threads: docs/optimizers.md); statistics EMA 0.95; the roots' relative ridge
 * (pc_root_opts_default, as precondd); roots used from step 1 and whatever their age. */
void ac_shampoo_opts_default(ac_shampoo_opts *opts) {
  if (opts == NULL) return;
  pc_layout_opts_default(&opts->layout);
  pc_graft_opts_default(&opts->graft, PC_GRAFT_ADAM);
  opts->momentum = 0.0f;
  opts->nesterov = 0;
  opts->weight_decay = 0.0f;
  opts->stats_interval = 1;
  opts->start_step = 1;
  opts->max_staleness = 0;
  opts->beta2 = 0.95f;
  pc_root_opts ro; /* the relative ridge is the roots' own default: one source with precondd */
  pc_root_opts_default(&ro, 4);
  opts->epsilon = ro.epsilon;
  opts->beta1 = 0.9f;
  opts->beta1_nesterov = 1;
  opts->one_sided = 0;
  opts->root_method = PC_METHOD_EIGH; /* fp64 eigh in precondd: 2-5x cheaper than Newton at 128,
                                        * the same training (docs/optimizers.md) */
  opts->root_exponent = 2;
}

/* ------------------------------------------------------------------------------------ */
/* Checks                                                                                  */

static int graft_opts_check(const pc_graft_opts *g) {
  switch (g->kind) {
    case PC_GRAFT_SGD:
      return AC_OK;
    case PC_GRAFT_ADAM_NORMED:
    case PC_GRAFT_ADAM:
      if (!ac__optim_in_range(g->beta1, 0.0, 1.0)) return AC_EINVAL;
      /* fall through */
    case PC_GRAFT_RMSPROP_NORMED:
    case PC_GRAFT_RMSPROP:
      if (!ac__optim_in_range(g->beta2, 0.0, 1.0)) return AC_EINVAL;
      /* fall through */
    case PC_GRAFT_ADAGRAD:
      /* in float on the device: eps must survive the conversion */
      return g->eps > 0.0 && isfinite((float)g->eps) && (float)g->eps > 0.0f ? AC_OK : AC_EINVAL;
  }
  return AC_EINVAL;
}

static int shampoo_opts_check(const ac_shampoo_opts *o) {
  if (o->layout.block_size == 0 || o->layout.skip_limit == 0 ||
      graft_opts_check(&o->graft) != AC_OK ||
      !ac__optim_momentum_opts_ok(o->momentum, o->nesterov, o->weight_decay) ||
      o->stats_interval < 1 || o->start_step < 1 || o->max_staleness < 0 ||
      !(o->beta2 >= 0.0f && o->beta2 <= 1.0f) || !(o->epsilon > 0.0) || !isfinite(o->epsilon) ||
      !ac__optim_in_range(o->beta1, 0.0, 1.0) ||
      (o->beta1_nesterov != 0 && o->beta1_nesterov != 1) ||
      (o->beta1_nesterov && o->beta1 == 0.0f) || (o->one_sided != 0 && o->one_sided != 1) ||
      (o->root_method != PC_METHOD_NEWTON && o->root_method != PC_METHOD_EIGH) ||
      o->root_exponent < 1 || o->root_exponent > 64)
    return AC_EINVAL;
  /* The normed grafts divide by |G| of the raw gradient; the filtered one has no such norm
   * that means the same thing, so they take the raw gradient only. */
  if (o->beta1 > 0.0f &&
      (o->graft.kind == PC_GRAFT_RMSPROP_NORMED || o->graft.kind == PC_GRAFT_ADAM_NORMED))
    return AC_EINVAL;
  return AC_OK;
}

/* values: also check that every value is finite (set_roots_host checks them as it unpacks). */
static int roots_check(const ac_shampoo *s, size_t b, const ac_shampoo_roots *roots, int values) {
  if (s == NULL || roots == NULL || b >= s->nblocks) return AC_EINVAL;
  const ac_root_format fmt = roots->format;
  const size_t n_left = roots->n_left, n_right = roots->n_right;
  const float *left = roots->left, *right = roots->right;
  if (roots->version == 0 || (fmt != AC_ROOT_DENSE && fmt != AC_ROOT_PACKED) ||
      (left == NULL && right == NULL))
    return AC_EINVAL;
  const pc_block *blk = &s->blocks[b].blk;
  if ((left != NULL && n_left != blk->rows) || (left == NULL && n_left != 0) ||
      (right != NULL && n_right != blk->cols) || (right == NULL && n_right != 0))
    return AC_EMISMATCH;
  /* The daemon checks too, but a NaN root would silently poison every later step. */
  if (!values) return AC_OK;
  size_t nl = fmt == AC_ROOT_PACKED ? ac_packed_len(n_left) : n_left * n_left;
  size_t nr = fmt == AC_ROOT_PACKED ? ac_packed_len(n_right) : n_right * n_right;
  if ((left != NULL && !pc_all_finite_f32(nl, left)) ||
      (right != NULL && !pc_all_finite_f32(nr, right)))
    return AC_EINVAL;
  return AC_OK;
}

/* ------------------------------------------------------------------------------------ */
/* Create and destroy                                                                      */

void ac_shampoo_destroy(ac_shampoo *s) {
  if (s == NULL) return;
  for (size_t i = 0; s->params != NULL && i < s->nparams; i++) {
    shampoo_param *sp = &s->params[i];
    ac_free(s->be, sp->m);
    ac_free(s->be, sp->v);
    ac_free(s->be, sp->buf);
    ac_free(s->be, sp->f);
    pc_layout_destroy(&sp->layout);
  }
  for (size_t b = 0; s->blocks != NULL && b < s->nblocks; b++) {
    ac_free(s->be, s->blocks[b].lroot);
    ac_free(s->be, s->blocks[b].rroot);
  }
  ac_free(s->be, s->stats_dev);
  ac_free(s->be, s->d);
  ac_free(s->be, s->a);
  ac_free(s->be, s->b);
  ac_free(s->be, s->x);
  ac_free(s->be, s->t);
  ac_free(s->be, s->stage);
  ac_free(s->be, s->spare[0]);
  ac_free(s->be, s->spare[1]);
  ac_free(s->be, s->norms_dev);
  free(s->norms_host);
  if (!s->host_memory) free(s->stats_host);
  free(s->blocks);
  free(s->params);
  free(s);
}

/* Lays out every parameter and counts what the blocks need. */
static int make_layouts(ac_shampoo *s, size_t *max_block, size_t *max_order) {
  *max_block = *max_order = 0;
  for (size_t i = 0; i < s->nparams; i++) {
    const ac_tensor *v = &s->params[i].p->value;
    const size_t one = 1;
    int rc = v->ndim == 0
                 ? pc_layout_init(&s->params[i].layout, 1, &one, &s->opts.layout)
                 : pc_layout_init(&s->params[i].layout, v->ndim, v->shape, &s->opts.layout);
    if (rc == PC_ENOMEM) return AC_ENOMEM;
    if (rc != PC_OK) return AC_EINVAL;
    const pc_layout *l = &s->params[i].layout;
    s->params[i].first_block = s->nblocks;
    s->nblocks += l->nblocks;
    if (l->nblocks > s->max_blocks) s->max_blocks = l->nblocks;
    for (size_t k = 0; k < l->nblocks; k++) {
      const pc_block *blk = &l->blocks[k];
      if (blk->rows * blk->cols > *max_block) *max_block = blk->rows * blk->cols;
      if (blk->rows > *max_order) *max_order = blk->rows;
      if (blk->cols > *max_order) *max_order = blk->cols;
      s->stats_len += ac_packed_len(blk->rows) + ac_packed_len(blk->cols);
    }
  }
  return AC_OK;
}

static int make_blocks(ac_shampoo *s) {
  size_t off = 0;
  s->blocks = calloc(s->nblocks ? s->nblocks : 1, sizeof *s->blocks);
  if (s->blocks == NULL) return AC_ENOMEM;
  for (size_t i = 0; i < s->nparams; i++) {
    const pc_layout *l = &s->params[i].layout;
    for (size_t k = 0; k < l->nblocks; k++) {
      shampoo_block *sb = &s->blocks[s->params[i].first_block + k];
      sb->param = i;
      sb->index = k;
      sb->blk = l->blocks[k];
      sb->stats_off = off;
      sb->staleness = -1;
      off += ac_packed_len(sb->blk.rows) + ac_packed_len(sb->blk.cols);
    }
  }
  return AC_OK;
}

/* Whether the graft keeps its own first moment: Adam's, unless the step's first moment is
 * on, which then is the graft's too (Distributed Shampoo's Adam graft is RMSprop applied
 * to the filtered gradient). */
static int graft_own_m(const ac_shampoo_opts *o) {
  return o->graft.kind == PC_GRAFT_ADAM_NORMED ||
         (o->graft.kind == PC_GRAFT_ADAM && o->beta1 == 0.0f);
}

/* Per-parameter device state: graft moments as the kind needs them, first moment, momentum. */
static int make_state(ac_shampoo *s) {
  const pc_graft kind = s->opts.graft.kind;
  for (size_t i = 0; i < s->nparams; i++) {
    shampoo_param *sp = &s->params[i];
    size_t n = sp->p->value.numel;
    int rc = AC_OK;
    if (graft_own_m(&s->opts)) rc = ac__optim_zeros(s->be, n, &sp->m);
    if (rc == AC_OK && s->opts.beta1 > 0.0f) rc = ac__optim_zeros(s->be, n, &sp->f);
    if (rc == AC_OK && kind != PC_GRAFT_SGD) rc = ac__optim_zeros(s->be, n, &sp->v);
    if (rc == AC_OK && s->opts.momentum > 0.0f) rc = ac__optim_zeros(s->be, n, &sp->buf);
    if (rc != AC_OK) return rc;
  }
  return AC_OK;
}

int ac_shampoo_create(ac_shampoo **out, ac_param *const *params, size_t nparams,
                      const ac_shampoo_opts *opts) {
  ac_shampoo_opts defaults;
  ac_backend *be = NULL;
  size_t max_numel = 0, max_block = 0, max_order = 0;
  ac_shampoo *s = NULL;
  int rc;

  if (out == NULL) return AC_EINVAL;
  *out = NULL;
  if (opts == NULL) {
    ac_shampoo_opts_default(&defaults);
    opts = &defaults;
  }
  rc = ac__optim_params_usable(params, nparams, &be, &max_numel);
  if (rc != AC_OK) return rc;
  if (shampoo_opts_check(opts) != AC_OK) return AC_EINVAL;

  rc = AC_ENOMEM;
  s = calloc(1, sizeof *s);
  if (s == NULL) goto fail;
  s->be = be;
  s->opts = *opts;
  s->nparams = nparams;
  s->params = calloc(nparams, sizeof *s->params);
  if (s->params == NULL) goto fail;
  for (size_t i = 0; i < nparams; i++) s->params[i].p = params[i];

  rc = make_layouts(s, &max_block, &max_order);
  if (rc == AC_OK) rc = make_blocks(s);
  if (rc == AC_OK) rc = make_state(s);
  if (rc != AC_OK) goto fail;

  rc = AC_ENOMEM;
  s->host_memory = ac_backend_kind_of(be) == AC_BACKEND_CPU;
  if (!s->host_memory) s->stats_host = malloc((s->stats_len ? s->stats_len : 1) * sizeof(float));
  s->norms_host = malloc((2 * s->max_blocks + 1) * sizeof(float));
  if ((!s->host_memory && s->stats_host == NULL) || s->norms_host == NULL) goto fail;
  size_t nbytes[] = {max_numel,         max_numel,   max_numel,
                     max_numel,         max_block,   ac_packed_len(max_order),
                     2 * s->max_blocks, s->stats_len};
  float **bufs[] = {&s->d, &s->a, &s->b, &s->x, &s->t, &s->stage, &s->norms_dev, &s->stats_dev};
  for (size_t i = 0; i < sizeof bufs / sizeof bufs[0]; i++) {
    rc = ac_malloc(be, nbytes[i] * sizeof(float), (void **)bufs[i]);
    if (rc != AC_OK) goto fail;
  }
  /* The CPU backend's device memory is host memory: the statistics are handed out where syrk
   * wrote them (a 2 MB copy per step less on the main job's Transformer). */
  if (s->host_memory) s->stats_host = s->stats_dev;
  s->root_cap = max_order * max_order;
  for (int k = 0; k < 2 && s->host_memory && s->root_cap > 0; k++) {
    rc = ac_malloc(be, s->root_cap * sizeof(float), (void **)&s->spare[k]);
    if (rc != AC_OK) goto fail;
  }
  *out = s;
  return AC_OK;

fail:
  ac_shampoo_destroy(s);
  return rc;
}

/* ------------------------------------------------------------------------------------ */
/* Queries                                                                                 */

size_t ac_shampoo_nblocks(const ac_shampoo *s) {
  return s != NULL ? s->nblocks : 0;
}

const pc_layout *ac_shampoo_layout(const ac_shampoo *s, size_t param) {
  return s != NULL && param < s->nparams ? &s->params[param].layout : NULL;
}

int ac_shampoo_block_info(const ac_shampoo *s, size_t b, ac_shampoo_block *info) {
  if (s == NULL || info == NULL || b >= s->nblocks) return AC_EINVAL;
  const shampoo_block *sb = &s->blocks[b];
  info->param = sb->param;
  info->index = sb->index;
  info->block = sb->blk;
  info->version = sb->version;
  info->source_step = sb->source_step;
  info->fallback_steps = sb->fallback;
  info->staleness = sb->staleness;
  return AC_OK;
}

int ac_shampoo_last_step(const ac_shampoo *s, ac_shampoo_step_info *info) {
  if (s == NULL || info == NULL) return AC_EINVAL;
  *info = s->last;
  return AC_OK;
}

uint64_t ac_shampoo_fallback_total(const ac_shampoo *s) {
  return s != NULL ? s->fallback_total : 0;
}

long ac_shampoo_steps(const ac_shampoo *s) {
  return s != NULL ? s->steps : 0;
}

/* ------------------------------------------------------------------------------------ */
/* Statistics                                                                              */

int ac_shampoo_stats_due(const ac_shampoo *s, long *step) {
  const long t = s != NULL ? s->steps + 1 : 0;
  if (step != NULL) *step = t;
  return s != NULL && (t - 1) % s->opts.stats_interval == 0;
}

/* The gradient block of b and its row stride. */
static const float *block_grad(const ac_shampoo *s, const shampoo_block *sb, size_t *ld) {
  const shampoo_param *sp = &s->params[sb->param];
  *ld = sp->layout.cols;
  return ac_tensor_f32(&sp->p->grad) + sb->blk.row0 * *ld + sb->blk.col0;
}

int ac_shampoo_compute_stats_into(ac_shampoo *s, float *const *left, float *const *right, int *due,
                                  long *step) {
  if (due != NULL) *due = 0;
  int now = ac_shampoo_stats_due(s, step);
  if (s == NULL) return AC_EINVAL;
  if (!now) return AC_OK;
  if (left == NULL || right == NULL) return AC_EINVAL;
  s->stats_valid = 0; /* s's own buffers are not filled by this */
  for (size_t b = 0; b < s->nblocks; b++) {
    if (left[b] == NULL) continue;
    if (right[b] == NULL) return AC_EINVAL;
    const shampoo_block *sb = &s->blocks[b];
    size_t ld;
    const float *g = block_grad(s, sb, &ld);
    int rc = ac_syrk_packed_to_host(s->be, AC_NO_TRANS, sb->blk.rows, sb->blk.cols, 1.0f, g, ld,
                                    left[b]);
    if (rc == AC_OK)
      rc = ac_syrk_packed_to_host(s->be, AC_TRANS, sb->blk.cols, sb->blk.rows, 1.0f, g, ld,
                                  right[b]);
    if (rc != AC_OK) return rc;
  }
  if (due != NULL) *due = 1;
  return AC_OK;
}

int ac_shampoo_compute_stats(ac_shampoo *s, int *due, long *step) {
  if (due != NULL) *due = 0;
  int now = ac_shampoo_stats_due(s, step);
  if (s == NULL) return AC_EINVAL;
  if (!now) return AC_OK;

  for (size_t b = 0; b < s->nblocks; b++) {
    const shampoo_block *sb = &s->blocks[b];
    size_t ld;
    const float *g = block_grad(s, sb, &ld);
    float *left = s->stats_dev + sb->stats_off;
    float *right = left + ac_packed_len(sb->blk.rows);
    int rc =
        ac_syrk_packed(s->be, AC_NO_TRANS, sb->blk.rows, sb->blk.cols, 1.0f, g, ld, 0.0f, left);
    if (rc == AC_OK)
      rc = ac_syrk_packed(s->be, AC_TRANS, sb->blk.cols, sb->blk.rows, 1.0f, g, ld, 0.0f, right);
    if (rc != AC_OK) return rc;
  }
  s->stats_valid = 0;
  if (s->host_memory) {
    int rc = ac_sync(s->be); /* the statistics are read where they were written */
    if (rc != AC_OK) return rc;
  } else if (s->stats_len > 0) {
    int rc = ac_memcpy_d2h(s->be, s->stats_host, s->stats_dev, s->stats_len * sizeof(float));
    if (rc != AC_OK) return rc;
  }
  s->stats_valid = 1;
  if (due != NULL) *due = 1;
  return AC_OK;
}

int ac_shampoo_block_stats(const ac_shampoo *s, size_t b, const float **left, const float **right) {
  if (s == NULL || b >= s->nblocks || !s->stats_valid) return AC_EINVAL;
  const shampoo_block *sb = &s->blocks[b];
  if (left != NULL) *left = s->stats_host + sb->stats_off;
  if (right != NULL) *right = s->stats_host + sb->stats_off + ac_packed_len(sb->blk.rows);
  return AC_OK;
}

/* ------------------------------------------------------------------------------------ */
/* Roots                                                                                   */

/* One side's root into the dense device buffer dst (n x n). */
static int upload_root(ac_shampoo *s, size_t n, ac_root_format fmt, const float *host, float *dst) {
  if (fmt == AC_ROOT_DENSE) return ac_memcpy_h2d(s->be, dst, host, n * n * sizeof(float));
  if (s->host_memory) return ac_unpack_sym(s->be, n, host, dst, n); /* no staging copy */
  int rc = ac_memcpy_h2d(s->be, s->stage, host, ac_packed_len(n) * sizeof(float));
  return rc == AC_OK ? ac_unpack_sym(s->be, n, s->stage, dst, n) : rc;
}

/* Host memory (the CPU backend), packed roots: each side is unpacked into a spare dense
 * buffer while its values are checked, one pass over roots that the worker often reads
 * straight from where the daemon's core wrote them (roots by reference), then swapped in.
 * A refused version leaves the old roots. Every root buffer holds root_cap floats. */
static int set_roots_host(ac_shampoo *s, shampoo_block *sb, const ac_shampoo_roots *roots) {
  const float *side[2] = {roots->left, roots->right};
  const size_t n[2] = {roots->n_left, roots->n_right};
  float **held[2] = {&sb->lroot, &sb->rroot};
  int rc = AC_OK;
  /* Allocate first, so that a failure changes nothing the step reads. */
  for (int k = 0; k < 2 && rc == AC_OK; k++)
    if (side[k] != NULL && *held[k] == NULL)
      rc = ac_malloc(s->be, s->root_cap * sizeof(float), (void **)held[k]);
  for (int k = 0; k < 2 && rc == AC_OK; k++)
    if (side[k] != NULL && !pc_unpack_finite_f32(n[k], side[k], s->spare[k], n[k])) rc = AC_EINVAL;
  if (rc != AC_OK) return rc;
  for (int k = 0; k < 2; k++) {
    if (side[k] == NULL) continue;
    float *old = *held[k];
    *held[k] = s->spare[k];
    s->spare[k] = old;
  }
  sb->has_left = side[0] != NULL;
  sb->has_right = side[1] != NULL;
  sb->version = roots->version;
  sb->source_step = roots->source_step;
  return AC_OK;
}

int ac_shampoo_set_roots(ac_shampoo *s, size_t b, const ac_shampoo_roots *roots) {
  const int host = s != NULL && s->host_memory && roots != NULL && roots->format == AC_ROOT_PACKED;
  int rc = roots_check(s, b, roots, !host);
  if (rc != AC_OK) return rc;
  shampoo_block *sb = &s->blocks[b];
  const ac_root_format fmt = roots->format;
  const size_t n_left = roots->n_left, n_right = roots->n_right;
  const float *left = roots->left, *right = roots->right;
  if (roots->version <= sb->version) return AC_OK;
  if (host) return set_roots_host(s, sb, roots);

  /* Allocate both sides first, so that a failure changes nothing the step reads. */
  if (left != NULL && sb->lroot == NULL)
    rc = ac_malloc(s->be, n_left * n_left * sizeof(float), (void **)&sb->lroot);
  if (rc == AC_OK && right != NULL && sb->rroot == NULL)
    rc = ac_malloc(s->be, n_right * n_right * sizeof(float), (void **)&sb->rroot);
  if (rc != AC_OK) return rc;

  /* A failed upload leaves a side half written: drop the block's roots until the next
   * version rather than apply a torn one. */
  sb->has_left = sb->has_right = 0;
  sb->version = 0;
  if (left != NULL) rc = upload_root(s, n_left, fmt, left, sb->lroot);
  if (rc == AC_OK && right != NULL) rc = upload_root(s, n_right, fmt, right, sb->rroot);
  if (rc != AC_OK) return rc;
  sb->has_left = left != NULL;
  sb->has_right = right != NULL;
  sb->version = roots->version;
  sb->source_step = roots->source_step;
  return AC_OK;
}

int ac_shampoo_drop_roots(ac_shampoo *s, size_t b) {
  if (s == NULL || b >= s->nblocks) return AC_EINVAL;
  shampoo_block *sb = &s->blocks[b];
  sb->has_left = sb->has_right = 0;
  sb->version = 0; /* what roots_usable reads: the grafted step from now on */
  return AC_OK;
}

/* ------------------------------------------------------------------------------------ */
/* The step                                                                                */

/* The first moment of gradient g (n values) at step t into x: f = b1 f + (1 - b1) g, then
 * x = f / (1 - b1^t), or with Nesterov the look-ahead of Dozat (2016),
 * x = b1 f / (1 - b1^(t+1)) + (1 - b1) g / (1 - b1^t). */
static int first_moment(ac_shampoo *s, size_t n, const float *g, float *f, long t, float *x) {
  const double b1 = s->opts.beta1, c1 = 1.0 - pow(b1, (double)t);
  int rc = ac_axpby(s->be, n, (float)(1.0 - b1), g, (float)b1, f, f);
  if (rc != AC_OK) return rc;
  if (!s->opts.beta1_nesterov) return ac_affine(s->be, n, (float)(1.0 / c1), f, 0.0f, x);
  const double c1next = 1.0 - pow(b1, (double)(t + 1));
  return ac_axpby(s->be, n, (float)((1.0 - b1) / c1), g, (float)(b1 / c1next), f, x);
}

/* The grafted direction d of the step's gradient x (the first moment, or g itself), with
 * the formulas of pc_graft_direction_f32 (its second moment from the raw gradient g),
 * using the scratch buffers a and b. t is the step (>= 1). */
static int graft_direction(ac_shampoo *s, size_t n, const float *g, const float *x, float *m,
                           float *v, long t, float *d) {
  ac_backend *be = s->be;
  const pc_graft_opts *o = &s->opts.graft;
  const int normed = o->kind == PC_GRAFT_RMSPROP_NORMED || o->kind == PC_GRAFT_ADAM_NORMED;
  const float eps = (float)o->eps, b1 = (float)o->beta1, b2 = (float)o->beta2;
  float *a = s->a, *b = s->b;
  int rc = AC_OK;

  if (o->kind == PC_GRAFT_SGD) return ac_memcpy_d2d(be, d, x, n * sizeof(float));
  if (normed) {
    /* x is g here (create refuses a first moment with the normed kinds) */
    double sq = 0.0;
    rc = ac_sumsq_to_host(be, n, g, &sq);
    const double inv = sq > 0.0 ? 1.0 / sqrt(sq) : 0.0; /* a zero gradient stays zero */
    if (rc == AC_OK && isfinite((float)inv)) {
      rc = ac_affine(be, n, (float)inv, g, 0.0f, a);
    } else if (rc == AC_OK) {
      /* |g| below FLT_MIN: 1/|g| overflows a float, its square root does not (|g| is at
       * least the smallest subnormal), and no g[i] exceeds |g|: scale twice. */
      rc = ac_affine(be, n, (float)sqrt(inv), g, 0.0f, a);
      if (rc == AC_OK) rc = ac_affine(be, n, (float)sqrt(inv), a, 0.0f, a);
    }
    g = x = a;
  }
  /* b = g^2, then the second moment */
  if (rc == AC_OK) rc = ac_binary(be, AC_BIN_MUL, n, g, g, b);
  if (rc == AC_OK)
    rc = o->kind == PC_GRAFT_ADAGRAD ? ac_axpby(be, n, 1.0f, b, 1.0f, v, v)
                                     : ac_axpby(be, n, 1.0f - b2, b, b2, v, v);
  /* b = sqrt(v / c2) + eps; no bias correction for AdaGrad (a sum) and Lingvo's
   * rmsprop-normed */
  const int bias = o->kind != PC_GRAFT_ADAGRAD && o->kind != PC_GRAFT_RMSPROP_NORMED;
  const double c2 = bias ? 1.0 - pow(o->beta2, (double)t) : 1.0;
  if (rc == AC_OK && bias) rc = ac_affine(be, n, (float)(1.0 / c2), v, 0.0f, b);
  if (rc == AC_OK) rc = ac_unary(be, AC_UNARY_SQRT, n, bias ? b : v, b);
  if (rc == AC_OK) rc = ac_affine(be, n, 1.0f, b, eps, b);
  if (rc == AC_OK && m != NULL) {
    /* Adam's own first moment: m = b1 m + (1 - b1) x; the numerator m / c1 */
    const double c1 = 1.0 - pow(o->beta1, (double)t);
    rc = ac_axpby(be, n, 1.0f - b1, x, b1, m, m);
    if (rc == AC_OK) rc = ac_affine(be, n, (float)(1.0 / c1), m, 0.0f, d);
    x = d;
  }
  if (rc == AC_OK) rc = ac_binary(be, AC_BIN_DIV, n, x, b, d);
  return rc;
}

/* Whether the step's first moment and the graft run as one ac_moment_graft pass: a first
 * moment under a bias-corrected graft of the second moment alone (Adam's, whose first
 * moment is then the step's, or RMSprop's); the other kinds take the chain above. */
static int graft_fused(const ac_shampoo_opts *o) {
  return o->beta1 > 0.0f && (o->graft.kind == PC_GRAFT_ADAM || o->graft.kind == PC_GRAFT_RMSPROP);
}

/* first_moment then graft_direction in one pass, with the floats they compute. */
static int moment_graft(ac_shampoo *s, size_t n, const float *g, float *f, float *v, long t,
                        float *x, float *d) {
  const double b1 = s->opts.beta1, c1 = 1.0 - pow(b1, (double)t);
  const pc_graft_opts *o = &s->opts.graft;
  const float b2 = (float)o->beta2;
  ac_moment_graft_args a = {.f_new = (float)(1.0 - b1),
                            .f_keep = (float)b1,
                            .x_g = 0.0f,
                            .x_f = (float)(1.0 / c1),
                            .v_new = 1.0f - b2,
                            .v_keep = b2,
                            .v_scale = (float)(1.0 / (1.0 - pow(o->beta2, (double)t))),
                            .eps = (float)o->eps};
  if (s->opts.beta1_nesterov) {
    a.x_g = (float)((1.0 - b1) / c1);
    a.x_f = (float)(b1 / (1.0 - pow(b1, (double)(t + 1))));
  }
  return ac_moment_graft(s->be, n, g, f, v, x, d, &a);
}

/* P_b = L G_b R into the contiguous rows x cols buffer p (a missing root: identity). One-sided:
 * only the root of the smaller side of order > 1 (a rank-1 block's n x 1 view has a scalar
 * right factor, which grafting would cancel anyway). */
static int precondition_block(ac_shampoo *s, const shampoo_block *sb, const float *g, size_t ld,
                              float *p) {
  const size_t r = sb->blk.rows, c = sb->blk.cols;
  int has_left = sb->has_left, has_right = sb->has_right;
  if (s->opts.one_sided && has_left && has_right) {
    const int left_side = c == 1 || (r <= c && r > 1);
    has_left = left_side;
    has_right = !left_side;
  }
  if (has_left && has_right) {
    int rc = ac_sgemm(s->be, AC_NO_TRANS, AC_NO_TRANS, r, c, r, 1.0f, sb->lroot, r, g, ld, 0.0f,
                      s->t, c);
    return rc == AC_OK ? ac_sgemm(s->be, AC_NO_TRANS, AC_NO_TRANS, r, c, c, 1.0f, s->t, c,
                                  sb->rroot, c, 0.0f, p, c)
                       : rc;
  }
  if (has_left)
    return ac_sgemm(s->be, AC_NO_TRANS, AC_NO_TRANS, r, c, r, 1.0f, sb->lroot, r, g, ld, 0.0f, p,
                    c);
  return ac_sgemm(s->be, AC_NO_TRANS, AC_NO_TRANS, r, c, c, 1.0f, g, ld, sb->rroot, c, 0.0f, p, c);
}

/* Whether block sb's roots are used at step t; if so, *staleness says how old they are. */
static int roots_usable(const ac_shampoo *s, const shampoo_block *sb, long t, long *staleness) {
  if (t < s->opts.start_step || sb->version == 0) return 0;
  /* Roots from a step ahead of this one (a worker restarted behind the daemon) count as
   * fresh. */
  *staleness = sb->source_step >= (uint64_t)t ? 0 : (long)((uint64_t)t - sb->source_step);
  return s->opts.max_staleness == 0 || *staleness <= s->opts.max_staleness;
}

/* Overwrites the blocks of d (the parameter's grafted direction, its 2-D view) that hold
 * roots with the preconditioned step gradient g (the first moment, or the raw gradient)
 * rescaled to d's block norm; counts fallbacks. A block as wide as its parameter (ld == c)
 * is contiguous in d: its norm is taken there and its step written there, without the
 * copies through scratch b (the same values, in the same order). */
static int precondition_param(ac_shampoo *s, shampoo_param *sp, long t, const float *g, float *d) {
  const size_t ld = sp->layout.cols;
  size_t used = 0, off = 0;
  long age = 0;
  int rc = AC_OK;

  /* Pass 1: P_b and D_b into contiguous scratch (a, b), their norms into norms_dev. */
  for (size_t k = 0; k < sp->layout.nblocks && rc == AC_OK; k++) {
    shampoo_block *sb = &s->blocks[sp->first_block + k];
    const size_t r = sb->blk.rows, c = sb->blk.cols, at = sb->blk.row0 * ld + sb->blk.col0;
    if (!roots_usable(s, sb, t, &age)) {
      sb->fallback++;
      s->fallback_total++;
      s->last.fallback++;
      continue;
    }
    sb->staleness = age;
    s->last.preconditioned++;
    s->last.staleness_mean += (double)age;
    if (age > s->last.staleness_max) s->last.staleness_max = age;
    const float *db = ld == c ? d + at : s->b + off;
    rc = precondition_block(s, sb, g + at, ld, s->a + off);
    if (rc == AC_OK && ld != c) rc = ac_copy2d(s->be, r, c, d + at, ld, s->b + off, c);
    if (rc == AC_OK)
      rc = ac_reduce(s->be, AC_REDUCE_NORM2, 1, 1, r * c, 1.0f, s->a + off, 0.0f,
                     s->norms_dev + 2 * used);
    if (rc == AC_OK)
      rc = ac_reduce(s->be, AC_REDUCE_NORM2, 1, 1, r * c, 1.0f, db, 0.0f,
                     s->norms_dev + 2 * used + 1);
    off += r * c;
    used++;
  }
  if (rc != AC_OK || used == 0) return rc;
  rc = ac_memcpy_d2h(s->be, s->norms_host, s->norms_dev, 2 * used * sizeof(float));

  /* Pass 2: P_b * |D_b| / |P_b| over D_b; a P_b without a usable norm leaves D_b. */
  off = used = 0;
  for (size_t k = 0; k < sp->layout.nblocks && rc == AC_OK; k++) {
    const shampoo_block *sb = &s->blocks[sp->first_block + k];
    const size_t r = sb->blk.rows, c = sb->blk.cols, at = sb->blk.row0 * ld + sb->blk.col0;
    if (!roots_usable(s, sb, t, &age)) continue;
    const double np = s->norms_host[2 * used], nd = s->norms_host[2 * used + 1];
    const float scale = (float)(nd / np);
    /* pc_graft_rescale's rule (no usable norm: take D_b), extended to what float needs:
     * a subnormal |P_b| is too imprecise to rescale by, and the factor must be a float. */
    if (np >= FLT_MIN && isfinite(np) && isfinite(scale)) {
      float *pb = ld == c ? d + at : s->a + off;
      rc = ac_affine(s->be, r * c, scale, s->a + off, 0.0f, pb);
      if (rc == AC_OK && ld != c) rc = ac_copy2d(s->be, r, c, pb, c, d + at, ld);
    }
    off += r * c;
    used++;
  }
  return rc;
}

int ac_shampoo_step(ac_shampoo *s, float lr) {
  if (s == NULL || !ac__optim_lr_ok(lr)) return AC_EINVAL;
  const long t = s->steps + 1;
  const float mu = s->opts.momentum;
  memset(&s->last, 0, sizeof s->last);
  s->last.step = t;
  s->last.staleness_max = -1;
  for (size_t i = 0; i < s->nparams; i++) {
    shampoo_param *sp = &s->params[i];
    const size_t n = sp->p->value.numel;
    float *p = ac_tensor_f32(&sp->p->value);
    const float *u = s->d, *g = ac_tensor_f32(&sp->p->grad), *x = g;
    int rc = AC_OK;
    if (graft_fused(&s->opts)) {
      rc = moment_graft(s, n, g, sp->f, sp->v, t, s->x, s->d);
      x = s->x;
    } else {
      if (sp->f != NULL) {
        rc = first_moment(s, n, g, sp->f, t, s->x);
        x = s->x;
      }
      if (rc == AC_OK) rc = graft_direction(s, n, g, x, sp->m, sp->v, t, s->d);
    }
    if (rc == AC_OK && !sp->layout.diagonal) rc = precondition_param(s, sp, t, x, s->d);
    /* buf = mu buf + P; U = nesterov ? P + mu buf : buf */
    if (rc == AC_OK && sp->buf != NULL)
      rc = ac__optim_momentum(s->be, n, mu, s->opts.nesterov, s->d, sp->buf, s->d, &u);
    /* p -= lr (U + wd p) */
    if (rc == AC_OK) rc = ac_axpby(s->be, n, -lr, u, 1.0f - lr * s->opts.weight_decay, p, p);
    if (rc != AC_OK) return rc;
  }
  s->last.staleness_mean =
      s->last.preconditioned > 0 ? s->last.staleness_mean / (double)s->last.preconditioned : NAN;
  s->steps++;
  return AC_OK;
}
