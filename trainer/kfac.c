/*
 * kfac.c -- the K-FAC mode of the trainer library (docs/kfac.md). The worker half: factors
 * A and G of every dense and conv layer computed in backward through the layers' curvature
 * hooks (accel/kfac.c's kernels on the layer's own buffers), pushed to precondd, which keeps
 * their running averages and computes the damped inverses; batch norm's diagonal Fisher
 * kept here. Per step: push when the schedule made factors due, pick up the newest
 * inverses, precondition (G^-1 grad A^-1; grad / (F + lambda) for batch norm), KL clip over
 * everything preconditioned, then SGD with momentum and weight decay. A layer without
 * inverses yet takes the SGD step on its plain gradient (fallback).
 *
 * Layers are found by the first backward pass: the hook sees each layer's weight and bias
 * (the accel parameters), so registering waits for the first pt_step. The daemon's tensor
 * of a layer is its gradient matrix [out, in (+1 for the bias)], named after its weight.
 */
#include "trainer_internal.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

typedef enum { PT__KFAC_LAYER = 0, PT__KFAC_BN = 1 } pt__kfac_kind;

typedef struct {
  pt__kfac_kind kind;
  ac_hook_kind hook_kind;
  ac_param *weight, *bias; /* borrowed; bias NULL when none */
  size_t windex;           /* index of weight in t->params: the order of registration */
  size_t out, in;          /* gradient matrix out x in (bias not counted); BN: c, c */
  size_t na, ng;           /* factor orders: in + has_bias, out */
  uint32_t block_id;       /* the daemon's; UINT32_MAX: not served (SGD) */
  float *fa, *fg;          /* device, packed: this step's factors (BN: fisher gamma, beta) */
  float *ra, *rg;          /* BN: running averages of the fisher (device, c each) */
  int folds;               /* BN: fisher folds so far */
  /* device, dense: the inverses in use (NULL before the first), a_own and g_own or held's */
  const float *a_inv, *g_inv;
  float *a_own, *g_own; /* device, dense: the inverses unpacked or computed here */
  /* CPU backend: libprecond's whole inverses, read in place (one reference, released when
   * others replace them); else NULL */
  const precond_roots *held;
  float *p; /* device: preconditioned grad, weights then bias */
  uint64_t version, source_step;
  int due_seen; /* the hook filled fa/fg at the current step */
  int worker;   /* data parallelism: the worker that pushes its factors (pt__unit_worker) */
  uint64_t daemon_version; /* of the inverses held (the daemon's numbering: the same on every
                              worker, pt_dp_agree compares it) */
  /* The worker forms (pt_kfac_opts.form): the running averages of A and G on the host,
   * packed, as precondd keeps them; folds so far; the eigenvalues on the device (the eigen
   * form: a_own and g_own then hold Q_A and Q_G). */
  float *ha, *hg;
  uint64_t hfolds;
  float *va, *vg;
  /* libprecond's push slot the hook computed this step's factors into (pt__direct), which
   * pt__kfac_push commits; NULL: fa and fg hold them. */
  precond_push_slot *slot;
} pt__kfac_layer;

typedef struct {
  ac_backend *be;
  ac_sgd *sgd; /* owned: the final step over every parameter */
  pt__kfac_layer *layers;
  size_t nlayers, cap;
  int registered;
  long next_step; /* the step the coming backward belongs to */
  int due;        /* factors due at next_step (the hook computes them) */
  float *ws;      /* device scratch shared by the kernels */
  size_t ws_floats;
  float *stage; /* device staging for packed inverses */
  size_t stage_floats;
  float *host; /* host buffer for downloads of packed factors */
  size_t host_floats;
  float *hx; /* the worker forms: host scratch (a dense factor's result, packed copies) */
  size_t hx_floats;
  float *dev1; /* one device float for the KL clip */
  float *u;    /* device uniforms of the model Fisher's draws (u_floats) */
  size_t u_floats;
  uint64_t draws;           /* the draws' counter (ac_rand_uniform's offset) */
  int sampling;             /* the model Fisher's backward is running: the hook computes factors */
  pt__pace pace;            /* libprecond's poll, half a step (pt__poll_pace) */
  ac_kfac_pg *pg;           /* nlayers entries: the KL clip's list */
  precond_push_slot **slot; /* nlayers entries: libprecond's slots open this step; NULL
                               between steps */
  uint64_t applied, rejected, pushes;
  double lr_max;    /* the largest rate pt_step was given (kl_base_lr without a base_lr) */
  int hook_rc;      /* the first error a hook met (returned by pt_step too) */
  ac_bn_sync red;   /* data parallelism: the workers' mean (pt_dp_reduce); fn NULL alone */
  double factors_s; /* CPU seconds computing, reducing and pushing factors */
  double comm_s;    /* of which in reductions across the workers (MPI polls: CPU) */
  size_t nmine;     /* layers whose factors this worker pushes */
} pt__kfac;

/* ---- buffers ---------------------------------------------------------------------- */

static int pt__dev(ac_backend *be, size_t floats, float **out) {
  void *p = NULL;
  int rc = ac_malloc(be, (floats ? floats : 1) * sizeof(float), &p);
  *out = p;
  return rc;
}

/* Grows the shared device scratch to at least floats. */
static int pt__ws(pt__kfac *s, size_t floats) {
  if (floats <= s->ws_floats) return AC_OK;
  ac_free(s->be, s->ws);
  s->ws = NULL;
  s->ws_floats = 0;
  int rc = pt__dev(s->be, floats, &s->ws);
  if (rc == AC_OK) s->ws_floats = floats;
  return rc;
}

static int pt__grow_host(pt__kfac *s, size_t floats) {
  if (floats <= s->host_floats) return AC_OK;
  float *h = realloc(s->host, floats * sizeof *h);
  if (h == NULL) return AC_ENOMEM;
  s->host = h;
  s->host_floats = floats;
  return AC_OK;
}

/* ---- the hook --------------------------------------------------------------------- */

static size_t pt__param_index(const pt_trainer *t, const ac_param *p) {
  for (size_t i = 0; i < t->nparams; i++)
    if (t->params[i] == p) return i;
  return SIZE_MAX;
}

/* The layer record of view v, created at its first sight (before registration only: the
 * daemon's layout is fixed after it). NULL for a layer whose weight is not one of the
 * trainer's parameters (it keeps whatever the caller does with it). */
static pt__kfac_layer *pt__layer_of(pt_trainer *t, const ac_hook_view *v, int *rc) {
  pt__kfac *s = t->state;
  *rc = AC_OK;
  for (size_t i = 0; i < s->nlayers; i++)
    if (s->layers[i].weight == v->weight) return &s->layers[i];
  size_t wi = pt__param_index(t, v->weight);
  if (wi == SIZE_MAX || s->registered) return NULL;
  if (s->nlayers == s->cap) {
    size_t cap = s->cap ? 2 * s->cap : 16;
    pt__kfac_layer *l = realloc(s->layers, cap * sizeof *l);
    if (l == NULL) {
      *rc = AC_ENOMEM;
      return NULL;
    }
    s->layers = l;
    s->cap = cap;
  }
  pt__kfac_layer *l = &s->layers[s->nlayers];
  memset(l, 0, sizeof *l);
  l->hook_kind = v->kind;
  l->kind = v->kind == AC_HOOK_BATCHNORM ? PT__KFAC_BN : PT__KFAC_LAYER;
  l->weight = (ac_param *)(uintptr_t)v->weight;
  l->bias = (ac_param *)(uintptr_t)v->bias;
  l->windex = wi;
  l->out = v->out;
  l->in = v->in;
  l->block_id = UINT32_MAX;
  if (l->bias != NULL && pt__param_index(t, l->bias) == SIZE_MAX) l->bias = NULL;
  if (l->kind == PT__KFAC_BN) {
    l->na = l->ng = v->in;
    if ((*rc = pt__dev(s->be, v->in, &l->fa)) == AC_OK &&
        (*rc = pt__dev(s->be, v->in, &l->fg)) == AC_OK &&
        (*rc = pt__dev(s->be, v->in, &l->ra)) == AC_OK)
      *rc = pt__dev(s->be, v->in, &l->rg);
  } else {
    l->na = v->in + (v->bias != NULL);
    l->ng = v->out;
    if ((*rc = pt__dev(s->be, ac_packed_len(l->na), &l->fa)) == AC_OK)
      *rc = pt__dev(s->be, ac_packed_len(l->ng), &l->fg);
  }
  if (*rc == AC_OK) *rc = pt__dev(s->be, v->weight->value.numel + (l->bias ? l->out : 0), &l->p);
  s->nlayers++; /* even on error: destroy frees what was allocated */
  return *rc == AC_OK ? l : NULL;
}

/* Batch norm: the batch's diagonal Fisher, folded into the running average here. */
static int pt__hook_bn(pt__kfac *s, const pt_kfac_opts *o, pt__kfac_layer *l,
                       const ac_hook_view *v) {
  size_t count = v->batch * v->in * v->npos;
  float scale = o->loss_scale > 0.0f ? o->loss_scale : (float)v->batch;
  int rc = pt__ws(s, 2 * count + ac_kfac_bn_workspace_floats(v->batch, v->in, v->npos));
  if (rc != AC_OK) return rc;
  float *gmask = s->ws, *xhat = s->ws + count, *ws = s->ws + 2 * count;
  const float *g = v->g;
  if (v->relu_y != NULL) { /* the gradient at the affine output: the fused ReLU's mask */
    rc = ac_unary_backward(s->be, AC_UNARY_RELU, count, v->relu_y, v->g, gmask);
    g = gmask;
  }
  if (rc == AC_OK) rc = ac_batchnorm_xhat(v->bn, xhat);
  if (rc == AC_OK)
    rc = ac_kfac_bn_fisher(s->be, v->batch, v->in, v->npos, g, xhat, scale, l->fa, l->fg, ws);
  /* Data parallelism: every worker folds the batch's Fisher (the mean of the shares'), so
   * all precondition alike. */
  double t0 = pt__cpu_now();
  if (rc == AC_OK && s->red.fn != NULL) rc = s->red.fn(s->red.ctx, l->fa, v->in);
  if (rc == AC_OK && s->red.fn != NULL) rc = s->red.fn(s->red.ctx, l->fg, v->in);
  s->comm_s += pt__cpu_now() - t0;
  if (rc != AC_OK) return rc;
  /* The running average as the daemon keeps A and G (pc_kfac_fold: the first as is). */
  float keep = l->folds == 0 ? 0.0f : (float)o->k.factor_decay;
  rc = ac_axpby(s->be, v->in, 1.0f - keep, l->fa, keep, l->ra, l->ra);
  if (rc == AC_OK) rc = ac_axpby(s->be, v->in, 1.0f - keep, l->fg, keep, l->rg, l->rg);
  if (rc == AC_OK) l->folds++;
  return rc;
}

/* A worker's share of count items of the global batch (data parallelism: ceil(count / W);
 * alone: count). */
static size_t pt__share(const pt_trainer *t, size_t count) {
  size_t nw = t->opts.shard_size > 1 ? (size_t)t->opts.shard_size : 1;
  return (count + nw - 1) / nw;
}

/* The rows of a dense layer's factors at step (pt_kfac_opts.dense_rows, row_sample): n of
 * the layer's rows, every stride-th from first. A strided sample's first row cycles through
 * the stride from one step to the next, so over a cycle every row position is used. */
typedef struct {
  size_t n, first, stride;
} pt__rows;

static pt__rows pt__dense_rows(const pt_trainer *t, size_t rows, long step) {
  const pt_kfac_opts *o = &t->opts.kfac;
  size_t want = pt__share(t, o->dense_rows);
  pt__rows r = {rows, 0, 1};
  if (want == 0 || want >= rows) return r;
  r.n = want;
  if (o->row_sample == PT_KFAC_ROWS_STRIDED) {
    r.stride = rows / want;
    r.first = (size_t)(step - 1) % r.stride;
  }
  return r;
}

/* Whether the hook writes layer l's factors straight into a push slot (precond_push_begin)
 * rather than fa and fg, which pt__kfac_push then downloads into one: a registered dense
 * layer the daemon serves, pushed in fp32 by this worker alone, whose factors nothing else
 * reads (the worker forms fold them on the host; data-parallel shares are reduced first).
 * The same floats either way (ac_kfac_dense_factors_to_host), without the copy. */
static int pt__direct(const pt_trainer *t, const pt__kfac_layer *l) {
  const pt__kfac *s = t->state;
  return s->registered && l->kind == PT__KFAC_LAYER && l->hook_kind == AC_HOOK_DENSE &&
         l->block_id != UINT32_MAX && t->opts.shard_size <= 1 && !t->opts.kfac.push_bf16 &&
         t->opts.kfac.form == PT_KFAC_FORM_DAEMON;
}

static int pt__hook(void *ctx, const ac_hook_view *v) {
  pt_trainer *t = ctx;
  pt__kfac *s = t->state;
  const pt_kfac_opts *o = &t->opts.kfac;
  if (!s->due) return AC_OK; /* most steps after the first epoch: nothing to do */
  if (o->model_fisher && !s->sampling) return AC_OK; /* the batch's own backward */
  double t0 = pt__cpu_now();
  int rc = AC_OK;
  pt__kfac_layer *l = pt__layer_of(t, v, &rc);
  if (l == NULL) return rc;
  l->due_seen = 1;
  float scale = o->loss_scale > 0.0f ? o->loss_scale : (float)v->batch;
  int bias = l->bias != NULL;
  switch (v->kind) {
    case AC_HOOK_DENSE: {
      /* A subset of the rows is a matrix with the row stride times stride: the kernels read
       * it in place. The scale stays the whole batch's (the loss is a mean over all rows). */
      pt__rows r = pt__dense_rows(t, v->rows, s->next_step);
      const float *a = v->a + r.first * v->lda, *g = v->g + r.first * v->ldg;
      rc = pt__ws(s, ac_kfac_dense_workspace_floats(r.n, v->in, bias));
      if (rc == AC_OK && pt__direct(t, l)) {
        float *ha = NULL, *hg = NULL;
        if (l->slot != NULL) precond_push_cancel(l->slot); /* a step that failed before its push */
        l->slot = NULL;
        int prc = precond_push_begin(t->client, (uint64_t)s->next_step, l->block_id,
                                     (uint32_t)l->na, (uint32_t)l->ng, &ha, &hg, &l->slot);
        if (prc != PRECOND_OK) {
          rc = prc == PRECOND_ENOMEM ? AC_ENOMEM : AC_EINVAL;
          l->slot = NULL;
        } else {
          rc = ac_kfac_dense_factors_to_host(s->be, r.n, v->in, v->out, a, r.stride * v->lda, g,
                                             r.stride * v->ldg, bias, scale, ha, hg, s->ws);
        }
        break;
      }
      if (rc == AC_OK)
        rc = ac_kfac_dense_factor_a(s->be, r.n, v->in, a, r.stride * v->lda, bias, l->fa, s->ws);
      if (rc == AC_OK)
        rc = ac_kfac_dense_factor_g(s->be, r.n, v->out, g, r.stride * v->ldg, scale, l->fg);
      break;
    }
    case AC_HOOK_CONV: {
      /* A from the first a_images images (the chunk's columns are image-major, so a prefix
       * of them is a prefix of its images); G from all. Data-parallel: a_images of the
       * global batch, each worker its 1/W of them from its share (the A work falls as 1/W;
       * other images than one worker's first ones when the share holds more). */
      size_t ai = pt__share(t, o->a_images);
      size_t na = ai > 0 && ai < v->batch ? ai : v->batch;
      size_t use = v->first >= na ? 0 : na - v->first < v->nimg ? na - v->first : v->nimg;
      rc = pt__ws(s, ac_kfac_conv_cols_workspace_floats(v->in, v->cols, bias));
      if (rc == AC_OK && use > 0)
        rc = ac_kfac_conv_cols_factor_a(s->be, v->in, use * v->npos, v->a, v->lda, v->npos, bias,
                                        na, v->first > 0, l->fa, s->ws);
      if (rc == AC_OK)
        rc = ac_kfac_conv_cols_factor_g(s->be, v->out, v->cols, v->g, v->ldg, scale, v->batch,
                                        v->first > 0, l->fg);
      break;
    }
    case AC_HOOK_BATCHNORM:
      rc = pt__hook_bn(s, o, l, v);
      break;
  }
  if (rc != AC_OK && s->hook_rc == AC_OK) s->hook_rc = rc;
  s->factors_s += pt__cpu_now() - t0;
  return rc;
}

int pt_kfac_hook(pt_trainer *t, ac_hook *out) {
  if (t == NULL || out == NULL || t->mode != &pt__kfac_mode) return PT_EINVAL;
  *out = (ac_hook){pt__hook, t};
  return PT_OK;
}

int pt_kfac_model_fisher(pt_trainer *t, size_t rows, size_t cols, const float *probs,
                         int32_t *labels, int (*backward)(void *ctx), void *ctx, int *ran,
                         pt_error *err) {
  if (ran != NULL) *ran = 0;
  if (t == NULL || t->mode != &pt__kfac_mode || ran == NULL || backward == NULL)
    return pt__fail(err, PT_EINVAL, "pt_kfac_model_fisher: a K-FAC trainer and ran, backward");
  pt__kfac *s = t->state;
  if (!t->opts.kfac.model_fisher || !s->due) return PT_OK;
  int rc = AC_OK;
  if (rows > s->u_floats) {
    ac_free(s->be, s->u);
    s->u = NULL;
    s->u_floats = 0;
    if ((rc = pt__dev(s->be, rows, &s->u)) == AC_OK) s->u_floats = rows;
  }
  /* Data parallelism: a worker's rows are its share of the batch, so it takes their
   * uniforms (counter-based) and the workers draw what one worker would. */
  int nw = t->opts.shard_size > 1 ? t->opts.shard_size : 1, w = nw > 1 ? t->opts.shard_rank : 0;
  if (rc == AC_OK)
    rc = ac_rand_uniform(s->be, t->opts.kfac.sample_seed, s->draws + (uint64_t)w * rows, rows, 0.0f,
                         1.0f, s->u);
  if (rc == AC_OK) rc = ac_sample_rows(s->be, rows, cols, probs, s->u, labels);
  if (rc != AC_OK) return pt__accel(err, rc, "the model Fisher's draws");
  s->draws += (uint64_t)nw * rows;
  s->sampling = 1;
  int brc = backward(ctx);
  s->sampling = 0;
  if (brc != 0)
    return pt__fail(err, PT_EACCEL, "the model Fisher's backward pass failed (%d)", brc);
  if (s->hook_rc != AC_OK) return pt__accel(err, s->hook_rc, "K-FAC hook");
  *ran = 1;
  return PT_OK;
}

/* ---- create, register, bind ------------------------------------------------------- */

static int pt__kfac_create(pt_trainer *t, pt_error *err) {
  const pt_kfac_opts *o = &t->opts.kfac;
  if (pc_kfac_opts_check(&o->k) != PC_OK || o->steps_per_epoch < 1 || !(o->loss_scale >= 0.0f) ||
      !isfinite(o->loss_scale) || !(o->base_lr >= 0.0) || !isfinite(o->base_lr) || o->inverse < 0 ||
      o->inverse > PC_KFAC_INV_NEWTON + 1 || o->form < PT_KFAC_FORM_DAEMON ||
      o->form > PT_KFAC_FORM_WORKER_EIGEN || o->row_sample < PT_KFAC_ROWS_PREFIX ||
      o->row_sample > PT_KFAC_ROWS_STRIDED ||
      (o->form != PT_KFAC_FORM_DAEMON && t->opts.shard_size > 1))
    return pt__fail(err, PT_EINVAL,
                    "K-FAC options: pc_kfac_opts_check refused them, or "
                    "steps_per_epoch < 1, or a bad loss_scale, base_lr, inverse, form or "
                    "row_sample (the "
                    "worker forms are for one worker)");
  pt__kfac *s = calloc(1, sizeof *s);
  if (s == NULL) return PT_ENOMEM;
  t->state = s;
  s->be = t->params[0]->value.be;
  s->next_step = 1;
  s->due = pc_kfac_factor_due(&o->k, 1, o->steps_per_epoch);
  pt_dp_bn_sync(t->opts.shard_size > 1 ? t->opts.dp : NULL, s->be, &s->red);
  int rc = pt__accel(err, ac_sgd_create(&s->sgd, t->params, t->nparams, &o->sgd), "SGD");
  if (rc == PT_OK) rc = pt__accel(err, pt__dev(s->be, 1, &s->dev1), "K-FAC scratch");
  return rc;
}

static int pt__cmp_layer(const void *a, const void *b) {
  const pt__kfac_layer *x = a, *y = b;
  return x->windex < y->windex ? -1 : x->windex > y->windex;
}

/* The treatment of every parameter, on stderr: what the issue asks to be listed at start. */
static void pt__kfac_list(const pt_trainer *t) {
  const pt__kfac *s = t->state;
  fprintf(stderr, "kfac: %zu parameters; treatment of each:\n", t->nparams);
  for (size_t i = 0; i < t->nparams; i++) {
    const ac_param *p = t->params[i];
    const char *how =
        "SGD (no curvature hook: embedding, layer norm or a layer K-FAC does "
        "not model; its plain gradient)";
    char buf[200];
    for (size_t k = 0; k < s->nlayers; k++) {
      const pt__kfac_layer *l = &s->layers[k];
      if (l->weight != p && l->bias != p) continue;
      if (l->kind == PT__KFAC_BN) {
        how = "batch norm: diagonal Fisher on the worker, grad / (F + lambda)";
      } else if (l->block_id == UINT32_MAX) {
        how = "SGD (a factor above the daemon's max_order)";
      } else {
        static const char *const form[] = {"precondd's damped inverses",
                                           "damped inverses on the worker",
                                           "eigen form on the worker"};
        snprintf(buf, sizeof buf, "K-FAC %s, A %zu x %zu, G %zu x %zu, %s%s",
                 l->hook_kind == AC_HOOK_CONV ? "conv" : "dense", l->na, l->na, l->ng, l->ng,
                 form[t->opts.kfac.form], l->bias == p ? " (the bias: A's last row)" : "");
        how = buf;
      }
    }
    fprintf(stderr, "kfac:   %-32s %s\n", p->name, how);
  }
}

/* Registers the layers the first backward found, in parameter order, and binds the
 * daemon's answer (its block ids; a layer it leaves diagonal stays on SGD). */
static int pt__kfac_register(pt_trainer *t, pt_error *err) {
  pt__kfac *s = t->state;
  if (s->hook_rc != AC_OK) return pt__accel(err, s->hook_rc, "K-FAC hook");
  if (s->nlayers > 1) /* qsort with NULL (no layer seen) is undefined */
    qsort(s->layers, s->nlayers, sizeof *s->layers, pt__cmp_layer);
  size_t nk = 0;
  for (size_t i = 0; i < s->nlayers; i++) nk += s->layers[i].kind == PT__KFAC_LAYER;
  if (nk == 0)
    return pt__fail(err, PT_EINVAL,
                    "K-FAC: the backward pass showed no dense or conv layer "
                    "(is pt_kfac_hook's hook installed on the model?)");
  precond_tensor *ts = calloc(nk, sizeof *ts);
  uint64_t *shapes = calloc(2 * nk, sizeof *shapes);
  int rc = PT_OK;
  if (ts == NULL || shapes == NULL) {
    rc = PT_ENOMEM;
    goto done;
  }
  size_t k = 0;
  for (size_t i = 0; i < s->nlayers; i++) {
    pt__kfac_layer *l = &s->layers[i];
    if (l->kind != PT__KFAC_LAYER) continue;
    shapes[2 * k] = l->ng;
    shapes[2 * k + 1] = l->na;
    ts[k] = (precond_tensor){l->weight->name, 2, &shapes[2 * k]};
    k++;
  }
  const pc_kfac_opts *ko = &t->opts.kfac.k;
  precond_kfac_opts po = {.factor_decay = ko->factor_decay,
                          .damping = ko->damping,
                          .inv_every = (uint32_t)ko->inv_every,
                          .no_pi_damping = !ko->pi_damping,
                          .inverse = (precond_kfac_inverse)t->opts.kfac.inverse};
  int prc = precond_register_kfac(t->client, t->job, t->opts.worker, nk, ts, &po, &t->layout);
  if (prc != PRECOND_OK) {
    rc = pt__daemon(t, err, prc, "precondd refused to register the K-FAC job");
    goto done;
  }
  /* The daemon numbers the layers it serves in tensor order; the others are diagonal. */
  for (size_t b = 0; b < t->layout.nblocks; b++) {
    const precond_block *pb = &t->layout.blocks[b];
    size_t seen = 0;
    for (size_t i = 0; i < s->nlayers; i++) {
      pt__kfac_layer *l = &s->layers[i];
      if (l->kind != PT__KFAC_LAYER) continue;
      if (seen++ != pb->tensor) continue;
      if (pb->rows != l->ng || pb->cols != l->na) {
        rc = pt__fail(err, PT_EDAEMON,
                      "precondd's layer %u is %llux%llu, the worker's %s "
                      "%zux%zu",
                      pb->block_id, (unsigned long long)pb->rows, (unsigned long long)pb->cols,
                      l->weight->name, l->ng, l->na);
        goto done;
      }
      l->block_id = pb->block_id;
      l->worker = pt__unit_worker(t, b);
      s->nmine += l->worker == t->opts.shard_rank || t->opts.shard_size <= 1;
    }
  }
  s->registered = 1;
  s->pg = calloc(2 * s->nlayers, sizeof *s->pg);
  s->slot = calloc(s->nlayers, sizeof *s->slot);
  if (s->pg == NULL || s->slot == NULL) rc = PT_ENOMEM;
  if (rc == PT_OK && !t->opts.kfac.quiet) pt__kfac_list(t);
done:
  free(ts);
  free(shapes);
  return rc;
}

/* ---- a step ----------------------------------------------------------------------- */

/* The worker forms: folds the batch factors a and g (host, packed) into layer l's host
 * running averages with precondd's rule (pc_kfac_fold_f32, the first as is), so that they
 * are the daemon's to the bit. */
static int pt__kfac_fold_local(pt__kfac_layer *l, const float *a, const float *g, double decay) {
  size_t la = ac_packed_len(l->na), lg = ac_packed_len(l->ng);
  if (l->ha == NULL) {
    l->ha = malloc(la * sizeof *l->ha);
    l->hg = malloc(lg * sizeof *l->hg);
    if (l->ha == NULL || l->hg == NULL) return AC_ENOMEM;
  }
  pc_kfac_fold_f32(la, l->ha, a, decay, l->hfolds == 0);
  pc_kfac_fold_f32(lg, l->hg, g, decay, l->hfolds == 0);
  l->hfolds++;
  return AC_OK;
}

/* Pushes the factors the hook computed at step. Data-parallel: the factors of the batch
 * are the mean of the shares' (equal shares; A and G are means over rows), reduced to the
 * one worker that pushes the layer (pt__unit_worker), so the daemon sees one push per layer
 * and step as from one worker. Every worker goes through the layers in the same order.
 * The pushing worker downloads fp32 factors straight into libprecond's push slots (no copy
 * on this thread) and commits the step's slots together, so they leave in one push call
 * (as Shampoo's, precond_push_commit_all); bf16 pushes and the other workers' shares go
 * through the host buffer. Every slot opened is committed or cancelled exactly once. */
static int pt__kfac_push(pt_trainer *t, long step, pt_error *err) {
  pt__kfac *s = t->state;
  precond_encoding enc = t->opts.kfac.push_bf16 ? PRECOND_BF16 : PRECOND_FP32;
  double t0 = pt__cpu_now();
  int rc = PT_OK;
  size_t nslots = 0;
  for (size_t i = 0; i < s->nlayers && rc == PT_OK; i++) {
    pt__kfac_layer *l = &s->layers[i];
    if (l->kind != PT__KFAC_LAYER || l->block_id == UINT32_MAX || !l->due_seen) continue;
    size_t la = ac_packed_len(l->na), lg = ac_packed_len(l->ng);
    int dp = t->opts.shard_size > 1, mine = !dp || l->worker == t->opts.shard_rank;
    float *a = NULL, *g = NULL;
    precond_push_slot *slot = NULL;
    if (l->slot != NULL) { /* the hook wrote the factors there (pt__direct) */
      s->slot[nslots++] = l->slot;
      l->slot = NULL;
      continue;
    }
    if (mine && enc == PRECOND_FP32) {
      rc = pt__daemon(t, err,
                      precond_push_begin(t->client, (uint64_t)step, l->block_id, (uint32_t)l->na,
                                         (uint32_t)l->ng, &a, &g, &slot),
                      "precond_push_begin");
      if (rc == PT_OK) s->slot[nslots++] = slot;
    } else {
      rc = pt__accel(err, pt__grow_host(s, la + lg), "K-FAC host buffer");
      a = s->host;
      g = s->host + la;
    }
    if (rc == PT_OK) rc = pt__accel(err, ac_memcpy_d2h(s->be, a, l->fa, la * sizeof(float)), "A");
    if (rc == PT_OK) rc = pt__accel(err, ac_memcpy_d2h(s->be, g, l->fg, lg * sizeof(float)), "G");
    double t1 = pt__cpu_now();
    /* a and g are one span (the host buffer's, or the slot's: precond_push_begin), so the
     * layer's factors take one reduction */
    if (rc == PT_OK && dp && pt_dp_mean_to(t->opts.dp, a, la + lg, l->worker) != PT_OK)
      rc = pt__fail(err, PT_EINVAL, "K-FAC: reducing the factors of %s failed", l->weight->name);
    s->comm_s += pt__cpu_now() - t1;
    if (rc == PT_OK && t->opts.kfac.form != PT_KFAC_FORM_DAEMON)
      rc = pt__accel(err, pt__kfac_fold_local(l, a, g, t->opts.kfac.k.factor_decay),
                     "K-FAC running averages on the worker");
    if (rc == PT_OK && mine && slot == NULL)
      rc = pt__daemon(t, err,
                      precond_push_kfac(t->client, (uint64_t)step, l->block_id, (uint32_t)l->na, a,
                                        (uint32_t)l->ng, g, enc),
                      "precond_push_kfac");
  }
  if (rc == PT_OK && nslots > 0)
    rc = pt__daemon(t, err, precond_push_commit_all(t->client, s->slot, nslots),
                    "precond_push_commit_all");
  else
    for (size_t k = 0; k < nslots; k++) precond_push_cancel(s->slot[k]);
  for (size_t k = 0; k < nslots; k++) s->slot[k] = NULL;
  if (rc != PT_OK) return rc;
  s->pushes++;
  s->factors_s += pt__cpu_now() - t0;
  return PT_OK;
}

/* The device's dense a_own and g_own of layer l (allocated at the first call). */
static int pt__kfac_alloc_inv(pt__kfac *s, pt__kfac_layer *l) {
  int arc = AC_OK;
  if (l->a_own == NULL) {
    arc = pt__dev(s->be, l->na * l->na, &l->a_own);
    if (arc == AC_OK) arc = pt__dev(s->be, l->ng * l->ng, &l->g_own);
  }
  return arc;
}

/* Layer l's inverses are now a_own and g_own (libprecond's, if held, are given back). */
static void pt__kfac_use_own(pt__kfac_layer *l) {
  precond_roots_release(l->held);
  l->held = NULL;
  l->a_inv = l->a_own;
  l->g_inv = l->g_own;
}

/* The packed inverses a and g (host) of layer l onto the device, unpacked. */
static int pt__kfac_upload(pt__kfac *s, pt__kfac_layer *l, const float *a, const float *g) {
  size_t la = ac_packed_len(l->na), lg = ac_packed_len(l->ng);
  int arc = pt__kfac_alloc_inv(s, l);
  if (arc == AC_OK && la + lg > s->stage_floats) {
    ac_free(s->be, s->stage);
    s->stage = NULL;
    s->stage_floats = 0;
    arc = pt__dev(s->be, la + lg, &s->stage);
    if (arc == AC_OK) s->stage_floats = la + lg;
  }
  if (arc == AC_OK) arc = ac_memcpy_h2d(s->be, s->stage, a, la * sizeof(float));
  if (arc == AC_OK) arc = ac_memcpy_h2d(s->be, s->stage + la, g, lg * sizeof(float));
  if (arc == AC_OK) arc = ac_unpack_sym(s->be, l->na, s->stage, l->a_own, l->na);
  if (arc == AC_OK) arc = ac_unpack_sym(s->be, l->ng, s->stage + la, l->g_own, l->ng);
  if (arc == AC_OK) {
    pt__kfac_use_own(l);
    s->applied++;
  }
  return arc;
}

/* libprecond's whole inverses r of layer l (precond_options.kfac_dense; the reference is
 * taken over here). On the CPU backend the device's memory is the host's, so the step reads
 * them where libprecond's thread expanded them: taking a new version in is a pointer swap
 * (it was an unpacking pass over 6.4 MB on the Transformer, every 10 steps). Elsewhere one
 * copy onto the device, no unpacking kernel. The same floats as the packed path's. */
static int pt__kfac_take_whole(pt__kfac *s, pt__kfac_layer *l, const precond_roots *r) {
  if (ac_backend_kind_of(s->be) == AC_BACKEND_CPU) {
    precond_roots_release(l->held);
    l->held = r;
    l->a_inv = r->a_inv;
    l->g_inv = r->g_inv;
    s->applied++;
    return AC_OK;
  }
  int arc = pt__kfac_alloc_inv(s, l);
  if (arc == AC_OK) arc = ac_memcpy_h2d(s->be, l->a_own, r->a_inv, l->na * l->na * sizeof(float));
  if (arc == AC_OK) arc = ac_memcpy_h2d(s->be, l->g_own, r->g_inv, l->ng * l->ng * sizeof(float));
  if (arc == AC_OK) {
    pt__kfac_use_own(l);
    s->applied++;
  }
  precond_roots_release(r);
  return arc;
}

/* Takes the inverses r (libprecond's, released here or held; NULL: nothing) of layer l
 * onto the device. */
static int pt__kfac_apply(pt_trainer *t, pt__kfac_layer *l, const precond_roots *r, pt_error *err) {
  pt__kfac *s = t->state;
  if (r == NULL) return PT_OK;
  int arc = AC_OK;
  l->version = r->version; /* a refused version is not offered again */
  l->source_step = r->source_step;
  l->daemon_version = r->daemon_version;
  if (r->n_a != l->na || r->n_g != l->ng || r->a_inv == NULL || r->g_inv == NULL) {
    s->rejected++; /* libprecond checks the orders: only a changed layout gets here */
    precond_roots_release(r);
  } else if (r->kfac_dense) {
    arc = pt__kfac_take_whole(s, l, r);
  } else {
    arc = pt__kfac_upload(s, l, r->a_inv, r->g_inv);
    precond_roots_release(r);
  }
  return pt__accel(err, arc, "K-FAC inverses to the device");
}

/* The worker forms: layer l's preconditioner from its host running averages, as precondd
 * computes it (pc_kfac_damping_split, pc_kfac_inverse_f32 by the same method rule, packed
 * and unpacked as on the wire), or the eigen form (pc_kfac_eigen_f32 of A and G: Q onto
 * a_inv and g_inv, the eigenvalues onto va and vg). A failed computation keeps what is held,
 * counted as rejected (the daemon's rule). */
static int pt__kfac_local(pt_trainer *t, pt__kfac_layer *l, long step, pt_error *err) {
  pt__kfac *s = t->state;
  const pt_kfac_opts *o = &t->opts.kfac;
  size_t na = l->na, ng = l->ng, la = ac_packed_len(na), lg = ac_packed_len(ng);
  size_t need = na * na + ng * ng + la + lg + na + ng;
  if (need > s->hx_floats) {
    float *h = realloc(s->hx, need * sizeof *h);
    if (h == NULL) return pt__accel(err, AC_ENOMEM, "K-FAC worker form scratch");
    s->hx = h;
    s->hx_floats = need;
  }
  float *x = s->hx, *xg = x + na * na, *pa = xg + ng * ng, *pg = pa + la, *v = pg + lg;
  int prc = PC_OK, arc = AC_OK;
  if (o->form == PT_KFAC_FORM_WORKER_EIGEN) {
    /* Both factors decomposed before anything is uploaded: a failure keeps the held pair. */
    prc = pc_kfac_eigen_f32(na, l->ha, x, v);
    if (prc >= 0) prc = pc_kfac_eigen_f32(ng, l->hg, xg, v + na);
    if (prc >= 0) arc = pt__kfac_alloc_inv(s, l);
    if (prc >= 0 && arc == AC_OK && l->va == NULL && (arc = pt__dev(s->be, na, &l->va)) == AC_OK)
      arc = pt__dev(s->be, ng, &l->vg);
    if (prc >= 0 && arc == AC_OK) arc = ac_memcpy_h2d(s->be, l->a_own, x, na * na * sizeof(float));
    if (prc >= 0 && arc == AC_OK) arc = ac_memcpy_h2d(s->be, l->g_own, xg, ng * ng * sizeof(float));
    if (prc >= 0 && arc == AC_OK) arc = ac_memcpy_h2d(s->be, l->va, v, na * sizeof(float));
    if (prc >= 0 && arc == AC_OK) arc = ac_memcpy_h2d(s->be, l->vg, v + na, ng * sizeof(float));
    if (prc >= 0 && arc == AC_OK) {
      pt__kfac_use_own(l);
      s->applied++;
    }
  } else {
    pc_kfac_damping dmp;
    prc = pc_kfac_damping_split(na, pc_kfac_trace_f32(na, l->ha), ng, pc_kfac_trace_f32(ng, l->hg),
                                o->k.damping, o->k.pi_damping, &dmp);
    const size_t n[2] = {na, ng};
    const float *f[2] = {l->ha, l->hg};
    float *packed[2] = {pa, pg};
    const double damp[2] = {dmp.damp_a, dmp.damp_g};
    for (int k = 0; k < 2 && prc >= 0; k++) {
      pc_kfac_inv method =
          o->inverse ? (pc_kfac_inv)(o->inverse - 1) : pc_kfac_inv_for_size(&o->k, n[k]);
      pc_kfac_inv_info ii;
      prc = pc_kfac_inverse_f32(n[k], f[k], damp[k], method, x, &ii);
      if (prc >= 0) pc_pack_f32(n[k], x, packed[k]);
    }
    /* The daemon publishes a result with a warning (prc > 0) and keeps the old on an error. */
    if (prc >= 0) arc = pt__kfac_upload(s, l, pa, pg);
  }
  if (prc < 0) s->rejected++;
  if (prc >= 0 && arc == AC_OK) {
    l->version++;
    l->source_step = (uint64_t)step;
  }
  return pt__accel(err, arc, "K-FAC worker form");
}

/* Takes layer l's newest inverses from libprecond onto the device, if newer than held. */
static int pt__kfac_refresh(pt_trainer *t, pt__kfac_layer *l, pt_error *err) {
  const precond_roots *r = NULL;
  int rc =
      pt__daemon(t, err, precond_fetch(t->client, l->block_id, l->version, &r), "precond_fetch");
  return rc == PT_OK ? pt__kfac_apply(t, l, r, err) : rc;
}

/* Data-parallel workers without sync_roots: the layers' inverses by pt__refresh_agreed. */
static int pt__kfac_unit(pt_trainer *t, size_t i, uint32_t *block_id, uint64_t *version,
                         uint64_t *daemon_version) {
  const pt__kfac_layer *l = &((pt__kfac *)t->state)->layers[i];
  *block_id = l->block_id;
  *version = l->version;
  *daemon_version = l->daemon_version;
  return l->kind == PT__KFAC_LAYER && l->block_id != UINT32_MAX;
}

static int pt__kfac_apply_unit(pt_trainer *t, size_t i, const precond_roots *r, pt_error *err) {
  return pt__kfac_apply(t, &((pt__kfac *)t->state)->layers[i], r, err);
}

static int pt__kfac_refresh_agreed(pt_trainer *t, pt_error *err) {
  static const pt__agreed_units units = {pt__kfac_unit, pt__kfac_apply_unit, "inverse"};
  return pt__refresh_agreed(t, ((pt__kfac *)t->state)->nlayers, &units, err);
}

/* sync_roots: waits until layer l holds inverses computed from the factors of step. */
static int pt__kfac_wait(pt_trainer *t, pt__kfac_layer *l, long step, pt_error *err) {
  double deadline = pt__now() + t->opts.sync_timeout_ms / 1000.0;
  for (;;) {
    int rc = pt__kfac_refresh(t, l, err);
    if (rc != PT_OK) return rc;
    if (l->a_inv != NULL && l->source_step >= (uint64_t)step) return PT_OK;
    int left_ms = (int)((deadline - pt__now()) * 1000.0);
    if (left_ms <= 0 ||
        precond_wait_roots(t->client, l->block_id, l->version, left_ms) == PRECOND_ETIMEDOUT)
      return pt__fail(err, PT_ETIMEDOUT,
                      "sync_roots: no inverses of step %ld for %s within "
                      "%d ms",
                      step, l->weight->name, t->opts.sync_timeout_ms);
  }
}

/* Preconditions every layer that can be into l->p, KL-clips them together and copies the
 * result over the grads (the SGD step then reads it). Counts what was preconditioned. */
static int pt__kfac_precondition(pt_trainer *t, double lr, long step, pt_step_info *info,
                                 pt_error *err) {
  pt__kfac *s = t->state;
  const pc_kfac_opts *ko = &t->opts.kfac.k;
  size_t m = 0, nk = 0, npre = 0;
  double stale_sum = 0.0;
  long stale_max = -1;
  int arc = AC_OK;
  for (size_t i = 0; i < s->nlayers && arc == AC_OK; i++) {
    pt__kfac_layer *l = &s->layers[i];
    float *gw = ac_tensor_f32(&l->weight->grad);
    float *gb = l->bias ? ac_tensor_f32(&l->bias->grad) : NULL;
    size_t nw = l->weight->value.numel;
    nk += l->kind == PT__KFAC_LAYER;
    if (l->kind == PT__KFAC_BN) {
      if (l->folds == 0) continue;
      arc = pt__ws(s, l->in);
      if (arc == AC_OK)
        arc = ac_kfac_bn_precondition(s->be, l->in, gw, l->ra, (float)ko->damping, l->p, s->ws);
      if (arc == AC_OK && gb)
        arc =
            ac_kfac_bn_precondition(s->be, l->in, gb, l->rg, (float)ko->damping, l->p + nw, s->ws);
    } else {
      if (l->a_inv == NULL) continue;
      if (t->opts.kfac.form == PT_KFAC_FORM_WORKER_EIGEN) { /* a_inv, g_inv hold Q_A, Q_G */
        arc = pt__ws(s, ac_kfac_eigen_precondition_workspace_floats(l->out, l->in, gb != NULL));
        if (arc == AC_OK)
          arc = ac_kfac_eigen_precondition(s->be, l->out, l->in, gw, gb, l->g_inv, l->vg, l->a_inv,
                                           l->va, (float)ko->damping, l->p, gb ? l->p + nw : NULL,
                                           s->ws);
      } else {
        arc = pt__ws(s, ac_kfac_precondition_workspace_floats(l->out, l->in, gb != NULL));
        if (arc == AC_OK)
          arc = ac_kfac_precondition(s->be, l->out, l->in, gw, gb, l->g_inv, l->a_inv, l->p,
                                     gb ? l->p + nw : NULL, s->ws);
      }
      long age = step - (long)l->source_step;
      stale_sum += (double)age;
      stale_max = age > stale_max ? age : stale_max;
      npre++;
    }
    /* <p, grad> by tensor: the layer's p is one buffer, its grads are two tensors; the
     * clipped p goes over the grads (the SGD step reads them). */
    s->pg[m++] = (ac_kfac_pg){nw, l->p, gw, gw};
    if (gb) s->pg[m++] = (ac_kfac_pg){l->out, l->p + nw, gb, gb};
  }
  int rc = pt__accel(err, arc, "K-FAC precondition");
  /* kl_base_lr: nu from the base rate, then the step's rate scales nu p (the SGD step), so
   * the warm-up and the decay act on a clipped step too. */
  if (lr > s->lr_max) s->lr_max = lr;
  double base = t->opts.kfac.base_lr > 0.0 ? t->opts.kfac.base_lr : s->lr_max;
  double kl_lr = ko->kl_base_lr ? base : lr, nu = (double)NAN;
  if (rc == PT_OK && m > 0)
    rc = pt__accel(err, ac_kfac_kl_clip(s->be, s->pg, m, kl_lr, ko->kl_clip, s->dev1, &nu),
                   "K-FAC KL clip");
  if (info != NULL) {
    info->preconditioned = npre;
    info->fallback = nk - npre;
    info->staleness_mean = npre ? stale_sum / (double)npre : (double)NAN;
    info->staleness_max = stale_max;
    info->kl_scale = nu;
  }
  return rc;
}

static int pt__kfac_step(pt_trainer *t, long step, double lr, pt_step_info *info, pt_error *err) {
  pt__kfac *s = t->state;
  const pt_kfac_opts *o = &t->opts.kfac;
  pt__poll_pace(t, &s->pace);
  if (step != s->next_step)
    return pt__fail(err, PT_EINVAL,
                    "K-FAC: step %ld, expected %ld (steps are consecutive: "
                    "the hook computed this backward's factors for step %ld)",
                    step, s->next_step, s->next_step);
  if (s->hook_rc != AC_OK) return pt__accel(err, s->hook_rc, "K-FAC hook");
  int rc = s->registered ? PT_OK : pt__kfac_register(t, err);
  int pushed = 0;
  if (rc == PT_OK && s->due) {
    rc = pt__kfac_push(t, step, err);
    pushed = 1;
  }
  if (rc != PT_OK) return rc;
  /* sync_roots waits where the daemon computes: every inv_every pushes, and every push
   * until the first inverses (the daemon's counter, which pushes keep in step with here).
   * The worker forms compute at the same pushes, here: nothing to wait for or fetch. */
  int local = o->form != PT_KFAC_FORM_DAEMON;
  for (size_t i = 0; i < s->nlayers && rc == PT_OK && local && pushed; i++) {
    pt__kfac_layer *l = &s->layers[i];
    if (l->kind != PT__KFAC_LAYER || l->block_id == UINT32_MAX || !l->due_seen) continue;
    if (l->a_inv == NULL || s->pushes % (uint64_t)o->k.inv_every == 0)
      rc = pt__kfac_local(t, l, step, err);
  }
  int wait = pushed && t->opts.sync_roots && !local;
  if (wait && precond_flush(t->client, t->opts.sync_timeout_ms) != PRECOND_OK)
    return pt__fail(err, PT_ETIMEDOUT, "sync_roots: factors not sent within %d ms",
                    t->opts.sync_timeout_ms);
  int agreed = t->opts.shard_size > 1 && !t->opts.sync_roots;
  if (agreed) rc = pt__kfac_refresh_agreed(t, err);
  for (size_t i = 0; i < s->nlayers && rc == PT_OK && !agreed && !local; i++) {
    pt__kfac_layer *l = &s->layers[i];
    if (l->kind != PT__KFAC_LAYER || l->block_id == UINT32_MAX) continue;
    int computes = l->a_inv == NULL || s->pushes % (uint64_t)o->k.inv_every == 0;
    rc = wait && computes ? pt__kfac_wait(t, l, step, err) : pt__kfac_refresh(t, l, err);
  }
  if (rc == PT_OK) rc = pt__kfac_precondition(t, lr, step, info, err);
  if (rc == PT_OK) rc = pt__accel(err, ac_sgd_step(s->sgd, (float)lr), "SGD step");
  if (rc != PT_OK) return rc;
  for (size_t i = 0; i < s->nlayers; i++) s->layers[i].due_seen = 0;
  s->next_step = step + 1;
  s->due = pc_kfac_factor_due(&o->k, s->next_step, o->steps_per_epoch);
  if (info != NULL) info->pushed = pushed;
  return PT_OK;
}

static void pt__kfac_counters(const pt_trainer *t, pt_counters *out) {
  const pt__kfac *s = t->state;
  size_t n = 0;
  for (size_t i = 0; i < s->nlayers; i++)
    n += s->layers[i].kind == PT__KFAC_LAYER && s->layers[i].block_id != UINT32_MAX;
  out->units = n;
  out->units_mine = t->opts.shard_size > 1 ? s->nmine : n;
  out->stats_s = s->factors_s - s->comm_s; /* the reductions are pt_dp_reduce_seconds' */
  out->results_applied = s->applied;
  out->results_rejected = s->rejected;
}

static void pt__kfac_destroy(pt_trainer *t) {
  pt__kfac *s = t->state;
  if (s == NULL) return;
  for (size_t i = 0; i < s->nlayers; i++) {
    pt__kfac_layer *l = &s->layers[i];
    float *bufs[] = {l->fa, l->fg, l->ra, l->rg, l->a_own, l->g_own, l->p, l->va, l->vg};
    for (size_t k = 0; k < sizeof bufs / sizeof bufs[0]; k++) ac_free(s->be, bufs[k]);
    if (l->slot != NULL) precond_push_cancel(l->slot);
    precond_roots_release(l->held);
    free(l->ha);
    free(l->hg);
  }
  ac_free(s->be, s->ws);
  ac_free(s->be, s->stage);
  ac_free(s->be, s->dev1);
  ac_free(s->be, s->u);
  ac_sgd_destroy(s->sgd);
  free(s->layers);
  free(s->pg);
  free(s->slot);
  free(s->host);
  free(s->hx);
  free(s);
  t->state = NULL;
}

const pt__mode pt__kfac_mode = {
    .name = "kfac",
    .wire = PRECOND_MODE_KFAC,
    .create = pt__kfac_create,
    .register_opts = NULL, /* lazy_register: pt__kfac_register at the first step */
    .bind = NULL,
    .step = pt__kfac_step,
    .counters = pt__kfac_counters,
    .destroy = pt__kfac_destroy,
    .lazy_register = 1,
};
